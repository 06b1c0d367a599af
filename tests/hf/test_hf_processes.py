"""The federated LoRA example deployed for real, at test size: `shoal server` and three
`shoal client` processes over TLS (each node reading its own role's text), and three peers
built as `shoal peer` builds them, in one event loop. Only the adapters travel: the exchanged
spec is the adapters' and the bytes per update are the adapters' float32 plus a small header.
Every wait is bounded and every process is stopped by the test."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shoal.config import load_config  # noqa: E402 - after the skips
from shoal.metrics import read_jsonl  # noqa: E402
from shoal.params import ParamSpec  # noqa: E402
from shoal.pki import write_secret  # noqa: E402
from shoal.server.registry import Registry  # noqa: E402
from shoal.task import load_task, make_model  # noqa: E402
from shoal.tls import make_private_ca  # noqa: E402
from tests.spawn import kill_group, python_process, run_python

from ..p2p.network import LocalNetwork  # noqa: E402
from ..p2p.processes import free_ports  # noqa: E402
from .tiny import ADAPTER_NUMEL, TASK, TOML_ARGS, base_numel, needs_corpus  # noqa: E402

pytestmark = [needs_corpus, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HF = ("transformers", "peft")  # what each process of the example imports: the fork server imports them once
MAX_BODY = 4 * ADAPTER_NUMEL + 2048

SERVER_CONFIG = """
[task]
app = "{task}"
[task.args]
{args}
[simulation]
seed = 3
eval_every = 1
[train]
batch_size = 16
lr = 0.01
[server]
host = "127.0.0.1"
port = {port}
rounds = 2
min_nodes = 3
clients_per_round = 3
poll_s = 2.0
deadline_s = 60.0
max_body_bytes = {max_body}  # the adapters' float32 and a header: a body with the base would be refused (413)
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
tls_cert = "{cert}"
tls_key = "{key}"
"""


def adapter_spec_hash(seed: int = 3) -> str:
    """The spec hash of the adapters on the base that ``simulation.seed`` builds (the tiny base is
    made from a config, so its frozen weights, part of the hash, come from the seed)."""
    task = load_task(TASK, tomllib.loads(TOML_ARGS))  # the processes' [task.args]: the same base shapes
    model = make_model(task, seed=seed)
    spec = ParamSpec.of(model).with_base(model)  # as every trainer binds it: the base's digest too
    assert spec.numel == ADAPTER_NUMEL
    return spec.hash


def write_roles(folder: Path) -> list[Path]:
    """The three clients' text folders, as `python examples/hf/shakespeare_lora.py write-roles` writes them."""
    out = run_python(
        ["write-roles", str(folder), "--roles", "3"],
        script=REPO / "examples" / "hf" / "shakespeare_lora.py",
        timeout=60,
        preload=HF,
    )
    assert out.returncode == 0, out.stderr
    return [Path(line) for line in out.stdout.split()]


@pytest.mark.timeout(300)
def test_server_and_three_clients_over_tls_exchange_adapters_only(tmp_path):
    (port,) = free_ports(1)
    pki = make_private_ca(tmp_path / "pki")
    config = tmp_path / "server.toml"
    config.write_text(
        SERVER_CONFIG.format(
            task=TASK, args=TOML_ARGS, port=port, tmp=tmp_path, cert=pki.cert, key=pki.key, max_body=MAX_BODY
        )
    )
    reg = Registry(tmp_path / "nodes.sqlite")
    for i in range(3):
        write_secret(tmp_path / f"node{i}.token", reg.add(f"node{i}").encode())
    reg.close()
    roles = write_roles(tmp_path / "roles")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs, logs = [], []

    def run(args: list[str], tag: str) -> subprocess.Popen:
        log = tmp_path / f"{tag}.log"
        logs.append(log)
        p = python_process(args, log, env=env, preload=HF)
        procs.append(p)
        return p

    def dump() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in logs if p.exists())

    try:
        server = run(["server", "-c", str(config)], "server")
        for i in range(3):
            run(
                ["client", "--server", f"https://127.0.0.1:{port}", "--token-file", str(tmp_path / f"node{i}.token")]
                + ["-c", str(config), "--data", str(roles[i]), "--ca-cert", str(pki.ca_cert), "--device", "cpu"],
                f"node{i}",
            )
        try:
            assert server.wait(240) == 0, dump()
            for p in procs[1:]:
                assert p.wait(60) == 0, dump()
        except subprocess.TimeoutExpired:
            pytest.fail(f"a process did not finish in time\n{dump()}")
    finally:
        for p in procs:
            kill_group(p, 5)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    versions = [r for r in records if "evaluation" not in r]
    assert [r["version"] for r in versions] == [1, 2] and all(r["num_results"] == 3 for r in versions), records
    assert versions[-1]["test_perplexity"] < versions[0]["test_perplexity"] * 1.01  # the held-out role
    fed = [r for r in records if r.get("evaluation") == "federated"]
    assert fed and all(r["fed_nodes"] == 3 for r in fed)
    assert "Traceback" not in dump()
    # Every upload fitted in MAX_BODY (the server refuses a larger body): the adapters alone,
    # not the base, which is 14 times larger; the global model the server keeps is the adapters.
    assert 4 * base_numel() > 10 * MAX_BODY
    checkpoints = sorted((tmp_path / "ck").glob("ckpt-*.safetensors"))
    assert checkpoints and all(4 * ADAPTER_NUMEL < c.stat().st_size < 4 * ADAPTER_NUMEL + 2048 for c in checkpoints)
    assert "refused" not in (tmp_path / "server.log").read_text()


@pytest.mark.timeout(300)
def test_three_peers_gossip_the_adapters_only(tmp_path):
    """Three peers built as `shoal peer -c peer.toml --data client:<i>` builds them, in one event
    loop (tests/p2p/network.py: real HTTP between them, one transformers import)."""
    config = tmp_path / "peer.toml"
    config.write_text(
        f'[task]\napp = "{TASK}"\n[task.args]\n{TOML_ARGS}\n'
        "[simulation]\nnum_clients = 3\nseed = 5\n[train]\nlr = 0.01\nbatch_size = 16\n"
        "[gossip]\nperiod = 0.3\ntimeout = 10.0\nview_size = 2\nshuffle_length = 1\nmax_failures = 3\n"
    )

    async def main() -> dict[int, dict]:
        async with LocalNetwork(load_config(config), 3, tmp_path) as net:
            for i in range(3):
                net.start(i, [(i + 1) % 3])

            def trained():
                st = net.statuses(range(3))
                return st if all(s["steps"] >= 2 and s["merges"] >= 1 for s in st.values()) else None

            statuses = await net.wait_for(trained, 200, "3 peers to train 2 steps and merge")
            assert all(p.errors == 0 for p in net.peers.values())
            return statuses

    statuses = asyncio.run(main())
    ours = adapter_spec_hash(seed=5)
    assert {s["spec_hash"] for s in statuses.values()} == {ours}  # every peer exchanges the adapters' spec
    whole = 4 * base_numel()
    for i in range(3):
        records = read_jsonl(tmp_path / f"peer{i}" / "metrics.jsonl")
        assert {"test_perplexity", "local_test_perplexity"} <= set(records[-1]), records[-1]
        # a gossip step sends a model or two (push, pull reply) of the adapters' 8 KiB; one copy
        # of the whole model would be 126 KiB
        assert 0 < records[-1]["bytes_sent_per_round"] < whole / 2, records[-1]
