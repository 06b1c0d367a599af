"""Real processes on 127.0.0.1: a root, two edge aggregators (`shoal server --parent`) and
`shoal client` nodes, each given both edges. While both edges live the root's model is the
simulator's (HierFAVG's with two edge rounds per root round, to 1e-6; flat FedAvg's through secure
aggregation, to the encoding's precision); then one edge is SIGKILLed mid-run: its nodes re-attach
to the other edge (or are the round's drop-outs), the run finishes, and no accepted update is
counted twice. Distributed DP through the edges is accounted as at a flat root. Bounded: every wait
has a timeout and every process is killed at the end."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from shoal.accounting import epsilon
from shoal.server.checkpoint import load_checkpoint
from shoal.simulations.inprocess import InProcessSimulation

from .deploy import hierarchy

ROUNDS = 8  # root rounds take ~0.5 s here: the kill lands at version 2 or a little after, with rounds to spare
EXACT_ROUNDS = 2  # root rounds before the kill, checked against the simulator
DEADLINE_S = 10.0  # the root's: the round the dead edge held closes at it
EDGE_ROUNDS = {"hierarchy": "edge_rounds = 2"}  # HierFAVG: two edge rounds per root round


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_edge_processes_run_hierfavg_exactly_and_a_killed_edge_s_nodes_reattach(tmp_path):
    """Two edge rounds per root round (each edge's nodes train from the edge's own model in the
    second, and the edge sends one partial): the root's model is the simulator's HierFAVG model (to
    1e-6, clients trained one by one), which flat FedAvg's is not. Then edge-a is SIGKILLed: its
    nodes re-attach to edge-b and the run finishes; no accepted update is counted twice."""
    with hierarchy(tmp_path, n=4, edges=2, rounds=ROUNDS, deadline=DEADLINE_S, add=EDGE_ROUNDS) as h:
        rss: list[float] = []

        def sample() -> None:
            mb = h.rss_mb("root")
            if mb is not None:
                rss.append(mb)

        h.start_servers()
        h.start_nodes()
        st = h.wait_status(lambda s: s["version"] >= EXACT_ROUNDS, 150, sample)
        killed_at = st["version"]
        h.kill("edge-a")  # nodes 0 and 1 are its nodes
        assert h.wait("root", 90, sample) == 0, h.dump()
        for i in range(h.n):
            assert h.wait(h.shards[i].stem, 20) == 0, h.dump()
        assert h.wait("edge-b", 20) == 0, h.dump()
        records = h.records()
        edge_a, edge_b = h.edge_records("edge-a"), h.edge_records("edge-b")
        reattach = h.reattach_times()
        log = h.dump()

    assert [r["version"] for r in records] == list(range(1, ROUNDS + 1)), records
    # while both edges lived every node was counted, through its own edge, in both edge rounds
    assert all(r["num_results"] == 4 for r in records if r["version"] <= EXACT_ROUNDS), records
    assert all(r["hier_edges_reporting"] == 2 for r in records if r["version"] <= EXACT_ROUNDS), records
    for recs in (edge_a, edge_b):  # one partial per root round, of the root's version, both nodes inside
        early = [(r["version"], r["nodes_in"], r["answer"]) for r in recs if r["version"] < EXACT_ROUNDS]
        assert early == [(v, 2, "accepted") for v in range(EXACT_ROUNDS)], recs
    assert "edge round 2 of 2" in log, log
    # every update the root counted came in an edge's partial, each node once
    assert all(r["hier_nodes_via_edges"] == r["num_results"] for r in records), records
    sim_cfg = replace(
        h.cfg,
        hierarchy=replace(h.cfg.hierarchy, edges=2, edge_rounds=2, assignment="contiguous"),
        simulation=replace(h.cfg.simulation, batch_clients=1),
    )
    sim = InProcessSimulation.from_config(sim_cfg)
    ck = sorted((tmp_path / "ck").iterdir())
    for v in range(1, EXACT_ROUNDS + 1):
        sim.run_round()
        tensors = next(t for t, s in map(load_checkpoint, ck) if s["version"] == v)
        diff = float((tensors["params"] - sim.global_params).abs().max())
        assert diff <= 1e-6, (v, diff)
    flat = InProcessSimulation.from_config(replace(h.cfg, simulation=sim_cfg.simulation))
    for _ in range(EXACT_ROUNDS):
        flat.run_round()
    assert float((flat.global_params - sim.global_params).abs().max()) > 1e-4  # the edge rounds made a difference

    # after the kill: the round edge-a held is the drop-out of its nodes (at most), and from a later
    # round on both of them are counted through edge-b
    after = [r for r in records if r["version"] > killed_at]
    assert killed_at < ROUNDS - 1, records  # rounds were left after the kill
    assert all(2 <= r["num_results"] <= 4 for r in after), after
    assert any(r["num_results"] == 4 for r in after), (after, log)
    assert any(e["nodes_in"] == 4 for e in edge_b), edge_b
    assert len(reattach) == 2, log  # both of edge-a's nodes moved, each once
    # the root saw the same two moves (each at least edge_timeout_s after edge-a last named the node)
    moves = [r for r in records if r["hier_nodes_reattached"]]
    assert sum(r["hier_nodes_reattached"] for r in moves) == 2, records
    assert all(r["hier_reattach_s"] >= h.cfg.hierarchy.edge_timeout_s for r in moves), moves
    assert all(r["server_round_s"] > 0 and r["server_rss_mb"] > 0 for r in records), records
    # no update counted twice: the root counted exactly what the edges' taken partials held
    taken = [e for e in edge_a + edge_b if e["answer"] == "accepted"]
    assert sum(e["nodes_in"] for e in taken) == sum(r["num_results"] for r in records), (taken, records)
    assert not [e for e in edge_a + edge_b if e["answer"] in ("refused", "gave_up")], edge_a + edge_b
    durations = sorted(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:]))
    print(
        f"root round latency p50 {durations[len(durations) // 2]:.3f} s, max {durations[-1]:.3f} s; "
        f"re-attach {max(reattach):.3f} s; root RSS max {max(rss):.0f} MB"
    )


SECURE = """
[secure_aggregation]
enabled = true
bits = 24
clip = 1.0
stage_s = 4.0
"""
SECURE_ROUNDS = 6
SECURE_FLAT = 2  # rounds before the kill, checked against flat FedAvg


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_aggregation_through_edge_processes_and_a_killed_edge_s_nodes_are_drop_outs(tmp_path):
    """The tree with secure aggregation, 5 nodes (edge-a holds 3, edge-b 2): the edges relay the
    protocol to the root and send it one masked sum each. After 2 rounds the root's model is flat
    FedAvg's (the simulator, in the clear) to the fixed-point encoding's precision (24 bits over
    [-1, 1]). Then edge-b is SIGKILLed while round 3's protocol runs: its nodes are that round's
    drop-outs, recovered by the protocol (3 of 5 survive, the threshold is 3), so no round aborts;
    they re-attach to edge-a and later rounds count all 5 again."""
    with hierarchy(tmp_path, n=5, edges=2, rounds=SECURE_ROUNDS, deadline=4.0, extra=SECURE) as h:
        h.start_servers()
        h.start_nodes()
        st = h.wait_status(lambda s: s["secure_aggregation"].get("round", 0) > SECURE_FLAT, 150)
        h.kill("edge-b")  # nodes 3 and 4
        killed_in = st["secure_aggregation"]["round"]
        assert h.wait("root", 150) == 0, h.dump()
        assert h.wait("edge-a", 20) == 0, h.dump()
        records = h.records()
        sums = h.edge_records("edge-a") + h.edge_records("edge-b")
        log = h.dump()
    assert [r["version"] for r in records] == list(range(1, SECURE_ROUNDS + 1)), (records, log)
    assert all(r["num_results"] == 5 for r in records[:SECURE_FLAT]), records
    # one masked sum per edge and round before the kill, taken once, each of its nodes inside
    secure = sorted((e["round"], e["nodes_in"], e["answer"]) for e in sums if e["round"] <= SECURE_FLAT)
    assert secure == [(r, k, "accepted") for r in range(1, SECURE_FLAT + 1) for k in (2, 3)], sums
    ck = sorted((tmp_path / "ck").iterdir())
    tensors = next(t for t, s in map(load_checkpoint, ck) if s["version"] == SECURE_FLAT)
    cfg = h.cfg
    plain = InProcessSimulation.from_config(replace(cfg, secure_aggregation=type(cfg.secure_aggregation)()))
    for _ in range(SECURE_FLAT):
        plain.run_round()
    diff = float((tensors["params"] - plain.global_params).abs().max())
    assert 0 < diff <= 1e-5, diff  # masked, encoded, summed mod 2^32 and unmasked: the clear mean
    # the round edge-b died in completed with its nodes as drop-outs (or, killed after its sum was
    # taken, with them included: their self masks rebuilt from the others' shares)
    hit = next(r for r in records if r["version"] == killed_in)
    assert hit["num_results"] in (3, 5), (hit, log)
    assert all(r["num_results"] >= 3 for r in records), records
    # re-attached: a later round has all 5 through edge-a
    assert any(e["nodes_in"] == 5 and e["answer"] == "accepted" for e in h.edge_records("edge-a")), (sums, log)
    assert records[-1]["num_results"] == 5, records


DISTRIBUTED = """
[secure_aggregation]
enabled = true
bits = 24
clip = 10.0
stage_s = 4.0
[privacy]
mode = "distributed"
noise_multiplier = 1.0
clip_norm = 1.0
abort_bound = 0.0
"""  # the secure clip above C + 8 share stds (t >= 1), as the server requires; q = 1: no node's presence
# decides an abort without dropouts, and the operator declares none (privacy.abort_bound)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_dp_through_secure_edge_processes_is_accounted_as_flat(tmp_path):
    """Distributed DP on top of secure aggregation through 2 edges (4 nodes, 2 rounds; a third edge
    configured without DP stops at attach, and the run makes every version without it): every node clips, adds its
    noise share sized for t of the whole cohort (passed down by its edge from the root's task) and
    masks; the edges only relay and add masked vectors; the root unmasks the noisy sum and charges
    each round as a flat distributed-DP server would (its accountant's q and z)."""
    with hierarchy(
        tmp_path, n=4, edges=3, rounds=2, deadline=6.0, extra=DISTRIBUTED, add={"server": "clients_per_round = 4"}
    ) as h:
        # edge-c runs without the root's [privacy] table: it stops at attach with one line naming the key,
        # and its node (node 3: edge-c, then edge-a, edge-b) re-attaches to edge-a
        h.start_servers(edge_sets={"edge-c": {"privacy.mode": "none"}})
        assert h.wait("edge-c", 60) == 2, h.dump()
        h.start_nodes()
        assert h.wait("root", 200) == 0, h.dump()
        records = h.records()
        sums = h.edge_records("edge-a") + h.edge_records("edge-b")
        nodes = {p.stem: (tmp_path / f"{p.stem}.log").read_text() for p in h.shards}
        log = h.dump()
        refused = (tmp_path / "edge-c.log").read_text().strip().splitlines()
        root_log = (tmp_path / "root.log").read_text()
    assert "privacy.mode: this edge runs 'none', the root's rounds run 'distributed'" in refused[-1], refused
    # the refusal is not a failed poll to retry (a poll before the root listened may be: connection refused)
    assert not [line for line in refused if "poll of the root" in line and "Connect call failed" not in line], refused
    assert "edge edge-c refused" in root_log, root_log
    # a round may abort (e.g. opened before the nodes reached their edges: nobody advertised keys); it is
    # charged like any round that started and released as an empty round: noise alone, a version, a record
    # like any other's (the root's log says which)
    assert [r["version"] for r in records] == [1, 2] and not any("aborted" in r for r in records), (records, log)
    aborted = {int(k) for k in re.findall(r"round (\d+) aborted by secure aggregation; released as an empty", root_log)}
    done = [r for r in records if r["round"] not in aborted]
    assert done, (records, log)
    assert all(r["privacy_mode"] == "distributed" and r["release"] == "withhold" for r in records), records
    assert "num_results" not in done[0]  # withheld under DP, as at a flat root
    assert [r["rounds_charged"] for r in records] == list(range(1, len(records) + 1)), records
    for r in records:  # q = K / N with N the 4 nodes: the 3 edges are registered but are not nodes
        assert r["sampling_rate"] == 1.0, r
        assert r["epsilon"] == pytest.approx(epsilon(r["sampling_rate"], 1.0, r["rounds_charged"], 1e-5)), r
    # Poisson selection at q = K / N: in each completed round, the nodes inside the masked sums the root
    # took are the nodes that added a share, each one share sized for the round's t (its whole cohort)
    rounds = [r["round"] for r in done]
    inside = {k: sum(e["nodes_in"] for e in sums if e["round"] == k and e.get("answer") == "accepted") for k in rounds}
    assert all(k >= 1 for k in inside.values()), (sums, log)
    shares = re.findall(
        r"round (\d+): update of norm \S+ clipped to C = 1, noise share N\(0, \S+\) added \(t = (\d+)\)",
        "".join(nodes.values()),
    )
    added = sorted(int(k) for k, _ in shares if int(k) in inside)
    assert added == sorted(k for k, n in inside.items() for _ in range(n)), (shares, inside)
    assert all(1 <= int(t) <= 4 for _, t in shares), shares
