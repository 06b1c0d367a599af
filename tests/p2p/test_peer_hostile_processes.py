"""Two real `shoal peer` processes over HTTPS on 127.0.0.1 (a CA the test makes) take the
issue's probes from outside (a shuffle entry with a 64-character host label, user:pass@ and
metadata entries, a model of FLT_MAX, an age of 20 digits, a slice to a push-pull peer):
each gets its 4xx, nobody crashes or logs a traceback, honest merges go on, and SIGTERM
writes the final model and metrics and exits within a few seconds.

The well-formed shuffle the test sends names a sender no peer runs: peer 1's own shuffles carry
its clock's counter, and one sent after ours but taken first would make ours a replay (409).
Every /status read is a bounded wait, not one 3 s try: CI's load varies."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shoal.assembly import initial_model, task_from_config
from shoal.config import load_config
from shoal.p2p.group_average import SliceMessage, group_id
from shoal.p2p.model_wire import encode_slice
from shoal.params import ParamSpec
from shoal.tls import client_context, make_private_ca
from shoal.wire import encode_model

from .processes import free_ports, peer_status, start_peer, stop_peers, wait_for

TOKEN = "hostile-process-token"
SETTINGS = [
    "simulation.num_clients=2",
    "simulation.seed=3",
    'model.name="logreg"',
    "train.lr=0.01",
    "gossip.period=0.3",
    "gossip.timeout=2.0",
]


def _post(url: str, body: bytes, ctx) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {TOKEN}"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.timeout(180)
def test_real_peers_take_the_probes_and_stop_cleanly_on_sigterm(tmp_path):
    pki = make_private_ca(tmp_path)
    ctx = client_context(pki.ca_cert)
    ports = free_ports(3)  # the third: nobody listens there, the made-up sender of the well-formed shuffle
    urls = [f"https://127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for i in range(2):
            args = ["--listen", f"127.0.0.1:{ports[i]}", "--bootstrap", urls[1 - i], "--data", f"client:{i}"]
            args += ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--ca-cert", str(pki.ca_cert)]
            args += ["--out", str(tmp_path / f"peer{i}")]
            for s in SETTINGS:
                args += ["--set", s]
            procs.append(start_peer(args, TOKEN, tmp_path / f"peer{i}.log"))
        st = wait_for(
            lambda: (s := peer_status(urls[0], TOKEN, ctx)) and s["merges"] >= 1 and s,
            90,
            "peer 0 to merge",
            procs,
        )
        target = urls[0]
        cfg = load_config(None, SETTINGS)
        spec = ParamSpec.of(initial_model(cfg, task_from_config(cfg)))
        assert spec.hash == st["spec_hash"]
        sender = {"num_examples": 5, "sender": urls[1]}
        huge = torch.full((spec.numel,), torch.finfo(torch.float32).max)
        near = torch.zeros(spec.numel)
        members = tuple(sorted(urls))
        part = SliceMessage(urls[1], target, 10**6, group_id(10**6, members), members, 0, "part", 1.0, near[:5])
        long_label = "https://" + "a" * 64 + ".example.org:9000"

        def shuffle(sender: str, entries: list) -> bytes:  # with a counter: refused for what it probes
            return json.dumps({"sender": sender, "entries": entries, "seq": int(time.time() * 1e6)}).encode()

        probes = {
            "long label entry": ("/shuffle", shuffle(urls[1], [[long_label, 0]])),
            "userinfo entry": ("/shuffle", shuffle(urls[1], [["https://u:p@127.0.0.1:1", 0]])),
            "long label sender": ("/shuffle", shuffle(long_label, [])),
            "deep json": ("/shuffle", b"[" * 5000 + b"]" * 5000),
            "5000 digits": ("/shuffle", b'{"sender": "x", "entries": [["y", ' + b"9" * 5000 + b"]]}"),
            "FLT_MAX model": ("/gossip", encode_model(huge, spec, 1, {"age": 5, **sender})),
            "1e30 model": ("/gossip", encode_model(near + 1e30, spec, 1, {"age": 5, **sender})),
            "age 9999999999999999999": (
                "/gossip",
                encode_model(near, spec, 1, {"age": 99999999999999999999 // 10, **sender}),
            ),
            "true age": ("/gossip", encode_model(near, spec, 1, {"age": True, **sender})),
            "long label sender model": (
                "/gossip",
                encode_model(near, spec, 1, {"age": 1, "num_examples": 1, "sender": long_label}),
            ),
        }
        for name, (path, body) in probes.items():
            status, answer = _post(target + path, body, ctx)
            assert status == 400 and "error" in answer, name
            assert "shuffle body must be" not in answer["detail"], (name, answer)
        status, answer = _post(target + "/group", encode_slice(part, spec), ctx)  # a push-pull peer holds none
        assert status == 409 and answer["error"] == "not_running"
        # metadata entries are well formed: taken, never contacted (from a sender whose counter we own)
        status, answer = _post(target + "/shuffle", shuffle(urls[2], [["https://169.254.169.254:80", 0]]), ctx)
        assert status == 200, answer
        before = wait_for(lambda: peer_status(target, TOKEN, ctx), 30, "peer 0's status", procs)
        after = wait_for(
            lambda: (s := peer_status(target, TOKEN, ctx)) and s["merges"] > before["merges"] + 1 and s,
            60,
            "honest merges after the probes",
            procs,
        )
        assert "https://169.254.169.254:80" not in after["view"]
        other = wait_for(lambda: peer_status(urls[1], TOKEN, ctx), 30, "peer 1's status", procs)
        assert after["errors"] == 0 and other["errors"] == 0
        assert after["held"] == 0 and after["rejected"] >= len(probes)
        procs[0].send_signal(signal.SIGTERM)  # bounded by the wait, not timed: CI's load varies
        procs[0].wait(timeout=30)
        assert procs[0].returncode == 0
    finally:
        stop_peers(procs)
    for i in range(2):
        log = (tmp_path / f"peer{i}.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    saved = tmp_path / "peer0" / "model.safetensors"  # named tensors, as `shoal run pull` gives
    with safe_open(str(saved), "pt") as f:
        assert f.metadata()["spec_hash"] == after["spec_hash"]
    model = initial_model(cfg, task_from_config(cfg))
    model.load_state_dict(load_file(str(saved)))
    records = [json.loads(line) for line in (tmp_path / "peer0" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1].get("final") is True and records[-1]["round"] >= after["steps"]
