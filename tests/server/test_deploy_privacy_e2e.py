"""End to end with processes: `shoal server` + 5 `shoal client` processes on 127.0.0.1 with
central DP (adaptive clipping), distributed DP with secure aggregation (one node SIGKILLs
itself right after its masked input is accepted) and local DP-SGD on the nodes. Rounds
complete, epsilon is reported per round (metrics.jsonl, /v1/status, /metrics, the nodes'
logs), and privacy.target_epsilon stops the run before the budget is passed."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from shoal.accounting import epsilon
from shoal.accounting_dpsgd import LocalDpSgdAccountant, dp_sgd_schedule
from shoal.shards import load_shard

from .test_deploy import Deployment, _wait, deployment

N = 5
KILL_AFTER_MASKED = Path(__file__).with_name("kill_after_masked.py")


def _metrics(d: Deployment) -> str:
    req = urllib.request.Request(d.url + "/metrics", headers={"Authorization": f"Bearer {d.admin}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode()


def _records(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def _append(d: Deployment, text: str) -> None:
    with d.config.open("a") as f:
        f.write(text)


def _finish(d: Deployment, server, clients, timeout: float = 90) -> None:
    assert _wait(server, d, timeout) == 0, d.dump()
    for c in clients:
        assert _wait(c, d, 30) == 0, d.dump()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_central_dp_with_adaptive_clipping_stops_at_the_target(tmp_path):
    """Central DP-FedAvg, z = 1, q = 5/5: epsilon 4.73, 7.08, 9.01 after rounds 1-3, 10.7
    after a fourth; target 10 stops the run after round 3 of 10. The clip norm adapts."""
    with deployment(tmp_path, n=N, rounds=10) as d:
        _append(
            d,
            '\n[privacy]\nmode = "central"\nnoise_multiplier = 1.0\nclip_norm = 0.5\n'
            "adaptive_clipping = true\nclipped_count_stddev = 1.0\ntarget_epsilon = 10.0\n",
        )
        server = d.server("--insecure", "--set", f"server.clients_per_round={N}")
        # the status and /metrics before any node connects (the three rounds take seconds, and the
        # server exits once they are done): what the run will charge, nothing charged yet
        st = d.wait_status(lambda s: s["version"] == 0, 90)
        p = st["privacy"]
        assert p["sampling"] == "poisson" and p["sampling_rate"] == 1.0 and p["registered_nodes"] == N
        assert p["rounds_charged"] == 0 and p["epsilon"] == 0
        prom = _metrics(d)
        assert "shoal_privacy_epsilon " in prom and "shoal_privacy_clip_norm " in prom
        assert "shoal_privacy_budget_exhausted 0" in prom
        clients = [d.client(i, "--set", "train.epochs=20") for i in range(N)]
        _finish(d, server, clients)
        server_log = (tmp_path / "server.log").read_text()
        assert (
            "stopping: privacy budget reached: epsilon = 9.01 now, 10.73 after one more round > "
            "privacy.target_epsilon = 10" in server_log
        ), server_log
        for i in range(N):
            log = (tmp_path / f"client-{i:05d}.log").read_text()
            assert "server reports done at version 3 (privacy budget reached" in log, log
    records = _records(tmp_path)
    assert [r["version"] for r in records] == [1, 2, 3, 3] and "stopped" in records[-1]
    # privacy.release = "withhold" (the default): no per-round count or loss beside the epsilon
    assert all(
        r["release"] == "withhold" and not {"num_results", "num_examples", "train_loss"} & set(r) for r in records
    )
    for r in records:
        assert r["epsilon"] == pytest.approx(epsilon(1.0, 1.0, r["rounds_charged"], 1e-5)) and r["epsilon"] <= 10
    clips = [r["clip_norm"] for r in records[:3]]
    assert len(set(clips)) == 3 and all(c > 0 for c in clips), clips


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_distributed_dp_with_secure_aggregation_and_a_node_killed_after_masking(tmp_path):
    """Each node clips, adds N(0, z^2 C^2 / 3) (t = 3 of 5, the protocol's threshold) and masks.
    Round 1: client-00004 dies right after its masked input is accepted; the 5 masked inputs
    (>= t) are unmasked without its shares. Round 2 runs with the 4 others (the dead node is
    still selected until it times out: its keys stage closes at the deadline)."""
    with deployment(tmp_path, n=N, rounds=2, deadline=6.0) as d:
        _append(
            d,
            # abort_bound = 0: the operator declares that no node's presence decides an abort (q = 1)
            '\n[privacy]\nmode = "distributed"\nnoise_multiplier = 1.0\nclip_norm = 1.0\nabort_bound = 0.0\n'
            "\n[secure_aggregation]\nenabled = true\nstage_s = 4.0\nclip = 6.0\n",
        )
        # the dead node counts as connected for poll_s + 5 s after its last word: round 1's unmask stage
        # waits stage_s for it, so a short poll_s could drop it below min_nodes = 5 before round 2 opens
        server = d.server("--insecure", "--set", f"server.clients_per_round={N}", "--set", "server.poll_s=10")
        clients = [d.client(i) for i in range(N - 1)]
        victim = d.client(N - 1, entry=KILL_AFTER_MASKED)
        assert _wait(victim, d, 90) == -signal.SIGKILL, d.dump()
        st = d.wait_status(lambda s: s["version"] >= 1, 60)
        assert st["privacy"]["noise_shares"] == 3 and st["privacy"]["rounds_charged"] >= 1
        _finish(d, server, clients)
        server_log = (tmp_path / "server.log").read_text()
        assert "each node adds N(0, 0.5774^2) for t = 3 survivors at least" in server_log, server_log
        assert "stage 'unmask' closed without 1 nodes (dropouts: client-00004)" in server_log, server_log
        assert "secure sum of 5 nodes unmasked" in server_log and "secure sum of 4 nodes unmasked" in server_log
        for i in range(N - 1):
            log = (tmp_path / f"client-{i:05d}.log").read_text()
            assert log.count("noise share N(0, 0.5774^2) added (t = 3)") == 2, log
    records = _records(tmp_path)
    assert [r["version"] for r in records] == [1, 2]
    assert all(
        r["release"] == "withhold" and not {"num_results", "num_examples", "train_loss"} & set(r) for r in records
    )
    assert [r["epsilon"] for r in records] == [pytest.approx(epsilon(1.0, 1.0, k, 1e-5)) for k in (1, 2)]
    assert all(r["privacy_mode"] == "distributed" and r["sampling"] == "poisson" for r in records)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_local_dp_nodes_report_their_epsilon_and_the_target_stops_the_run(tmp_path):
    """Each node trains with DP-SGD and accounts its own epsilon (its data size, batch 10, one
    epoch, its rounds); with release = clear the nodes report it, and the server shows every
    node's and the worst, and stops when the worst node's next round would pass target_epsilon
    (set between its epsilon after 2 and 3 rounds)."""
    with deployment(tmp_path, n=N, rounds=10) as d:
        sizes = {p.stem: int(load_shard(p).x.shape[0]) for p in d.shards}

        def accounted(name: str, rounds: int) -> LocalDpSgdAccountant:
            acc = LocalDpSgdAccountant({name: dp_sgd_schedule(sizes[name], 10, 1, steps=10)}, 1.0, 1e-5)
            for _ in range(rounds):
                acc.record_round([name])
            return acc

        worst = max(sizes, key=lambda n: accounted(n, 2).next_epsilon())
        target = (accounted(worst, 2).epsilon + accounted(worst, 2).next_epsilon()) / 2
        # release = clear: the nodes send their reports, which reveal roughly their sizes (docs/privacy.md)
        _append(
            d,
            f'\n[privacy]\nmode = "local"\nnoise_multiplier = 1.0\nclip_norm = 1.0\ntarget_epsilon = {target}\n'
            'release = "clear"\n',
        )
        server = d.server("--insecure")
        clients = [d.client(i) for i in range(N)]
        st = d.wait_status(lambda s: s["version"] >= 1 and len(s["privacy"]["node_epsilon"]) == N, 120)
        assert st["privacy"]["epsilon"] == max(r["epsilon"] for r in st["privacy"]["node_epsilon"].values())
        assert 'shoal_privacy_node_epsilon{node="client-00000"}' in _metrics(d)
        _finish(d, server, clients, 150)
        server_log = (tmp_path / "server.log").read_text()
        assert f"privacy.target_epsilon = {target:g}" in server_log and f"(the worst node, {worst})" in server_log
        for name in sizes:
            log = (tmp_path / f"{name}.log").read_text()
            for k in (1, 2):
                assert (
                    f"round {k}: local DP epsilon = {accounted(name, k).epsilon:.4g} at delta = 1e-05 after {k} "
                    "rounds" in log
                ), log
            assert "server reports done at version 2 (privacy budget reached" in log, log
            ledger = json.loads((tmp_path / f"{name}.token.privacy.json").read_text())
            assert ledger["rounds"] == 2 and ledger["node"] == name
    records = _records(tmp_path)
    assert [r["version"] for r in records] == [1, 2, 2] and "stopped" in records[-1]
    for k, r in zip((1, 2), records):
        assert r["epsilon"] == pytest.approx(max(accounted(n, k).epsilon for n in sizes)) and r["epsilon"] <= target
        assert r["epsilon_node"] == worst and r["nodes_reporting"] == N
