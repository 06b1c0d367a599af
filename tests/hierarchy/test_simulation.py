"""Virtual edge aggregators in the in-process simulator: exactly flat FedAvg with one edge round,
per-link bytes measured, lost edges are their clients' drop-out, HierFAVG's edge rounds run."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.simulations.experiment import run_simulation
from shoal.simulations.hierarchy import HierarchicalRound, assign_edges
from shoal.simulations.inprocess import InProcessSimulation

HUNDRED = [
    "simulation.num_clients=100",
    "simulation.clients_per_round=100",
    "simulation.rounds=2",
    "simulation.seed=5",
    "train.lr=0.05",
    "train.batch_size=inf",
]
# one client at a time: the vmap-batched trainer's float32 results depend on which clients share a
# batch (flat batched vs flat one by one already differ by 1e-4 after two rounds of 100 clients)
EXACT = ("simulation.batch_clients=1",)


START: list[torch.Tensor] = []  # the initial model (the same for every seed-5 run)


def run(*extra: str, rounds: int = 2) -> InProcessSimulation:
    sim = InProcessSimulation.from_config(load_config(None, [*HUNDRED, *extra]))
    START[:] = [sim.global_params.clone()]
    for _ in range(rounds):
        sim.run_round()
    return sim


def test_four_edges_one_edge_round_equal_flat_fedavg() -> None:
    flat = run(*EXACT)
    assert (flat.global_params - START[0]).abs().max() > 1e-3  # it trained
    for dtype in ("float32", "float64"):
        hier = run(*EXACT, "hierarchy.edges=4", f"hierarchy.partial_dtype={dtype}", "hierarchy.assignment=hash")
        assert isinstance(hier.runner, HierarchicalRound)
        assert len(hier.runner.reported) == 4 and hier.rounds.version == flat.rounds.version == 2
        torch.testing.assert_close(hier.global_params, flat.global_params, atol=1e-6, rtol=0)
        links = hier.runner.links.total
        # the root takes 4 partials instead of 100 updates (float64 partials: twice the bytes of float32)
        assert links["edge_root_up"] * (20 if dtype == "float32" else 10) < links["client_edge_up"]
        assert abs(links["client_edge_up"] - flat.wire.total_up) < 100  # the same uploads (headers hold losses)


def test_fedopt_at_the_root_also_equals_flat() -> None:
    extra = (*EXACT, "strategy.name=fedadam", "strategy.server_lr=0.01", "simulation.clients_per_round=30")
    flat = run(*extra)
    hier = run(*extra, "hierarchy.edges=4", "hierarchy.partial_dtype=float64")
    torch.testing.assert_close(hier.global_params, flat.global_params, atol=1e-6, rtol=0)


def test_assignment_covers_every_client_and_balances() -> None:
    ids = [f"c{i}" for i in range(103)]
    for how in ("contiguous", "hash", "random"):
        cfg = load_config(None, ["hierarchy.edges=4", f"hierarchy.assignment={how}"]).hierarchy
        edge_of = assign_edges(ids, cfg, seed=1)
        assert set(edge_of) == set(ids) and len(set(edge_of.values())) == 4
        sizes = sorted(list(edge_of.values()).count(e) for e in set(edge_of.values()))
        if how != "hash":
            assert sizes[-1] - sizes[0] <= 1


def test_lost_edges_drop_their_clients_and_the_run_goes_on(tmp_path) -> None:
    cfg = load_config(
        None,
        [
            *HUNDRED,
            "simulation.clients_per_round=40",
            "simulation.rounds=5",
            "hierarchy.edges=4",
            "hierarchy.edge_failure=0.3",
            f"output.dir={tmp_path}",
            "output.plots=false",
        ],
    )
    summary = run_simulation(cfg, progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 5
    lost = sum(r["hier_edges_lost"] for r in records)
    assert lost > 0 and summary["hierarchy_edges_lost_total"] == lost
    for r in records:
        assert r["hier_edges_reporting"] + r["hier_edges_lost"] <= 4
        if r["hier_edges_lost"] and r["hier_edges_reporting"]:
            assert r["num_results"] < 40  # the lost edges' clients dropped out
        if r["hier_edges_reporting"]:
            assert r["hier_bytes_edge_root_up"] > 0 and r["hier_bytes_edge_root_down"] > 0
    assert summary["hier_bytes_edge_root_up_total"] == sum(r["hier_bytes_edge_root_up"] for r in records)


def test_every_edge_lost_aborts_the_round_with_the_model_unchanged() -> None:
    sim = InProcessSimulation.from_config(
        load_config(None, [*HUNDRED, "hierarchy.edges=2", "hierarchy.edge_failure=1"])
    )
    before = sim.global_params.clone()
    summary = sim.run_round()
    assert summary.num_results == 0 and sim.rounds.version == 0
    assert torch.equal(sim.global_params, before)


def test_edge_rounds_move_the_model_further_per_root_round() -> None:
    """kappa_2 = 4: each root round carries four edge aggregations; one edge per client group
    with one client each and kappa_2 = 2 is plain local training twice (checked by hand)."""
    one = run("hierarchy.edges=4", rounds=1)
    four = run("hierarchy.edges=4", "hierarchy.edge_rounds=4", rounds=1)
    assert isinstance(four.runner, HierarchicalRound)
    start = START[0]
    assert (four.global_params - start).norm() > 1.5 * (one.global_params - start).norm()
    links = four.runner.links.total
    assert links["client_edge_down"] == 4 * one.runner.links.total["client_edge_down"]
    assert links["edge_root_up"] == one.runner.links.total["edge_root_up"]


def test_hierarchy_refuses_what_it_cannot_run_yet() -> None:
    for extra in ("robust.rule=median", "simulation.mode=async"):
        with pytest.raises(ConfigError, match="hierarchy.edges"):
            load_config(None, ["hierarchy.edges=2", extra])


def test_clients_of_a_lost_edge_reattach_and_the_round_equals_flat() -> None:
    """With reattach, a lost edge's clients report through the live edges: nothing is dropped, and
    with one edge round the root's sum is still the flat one."""
    few = (*EXACT, "simulation.clients_per_round=30")
    flat = run(*few, rounds=3)
    hier = run(*few, "hierarchy.edges=4", "hierarchy.edge_failure=0.4", "hierarchy.reattach=true", rounds=3)
    assert isinstance(hier.runner, HierarchicalRound)
    assert hier.runner.lost_total > 0 and hier.runner.reattached_total > 0
    torch.testing.assert_close(hier.global_params, flat.global_params, atol=1e-6, rtol=0)


SECURE = ("secure_aggregation.enabled=true", "secure_aggregation.bits=24", "secure_aggregation.clip=1.0")
TWELVE = (*EXACT, "simulation.num_clients=12", "simulation.clients_per_round=12")


def test_secure_aggregation_through_edges_equals_flat_secure_and_the_plain_hierarchy() -> None:
    """The edges relay the protocol and add masked vectors; the root unmasks: the same model as
    flat secure aggregation (the same encodings, summed in another order mod 2^32: bit for bit)
    and as the plain hierarchy to the encoding's precision (24 bits over [-1, 1]: 1.2e-7 a step)."""
    plain = run(*TWELVE, "hierarchy.edges=3")
    flat = run(*TWELVE, *SECURE)
    hier = run(*TWELVE, *SECURE, "hierarchy.edges=3")
    assert hier.runner.secure is not None and hier.runner.reported == ["edge-000", "edge-001", "edge-002"]
    assert torch.equal(hier.global_params, flat.global_params)
    torch.testing.assert_close(hier.global_params, plain.global_params, atol=2e-6, rtol=0)
    links = hier.runner.links.total
    assert links["edge_root_up"] < links["client_edge_up"]  # 3 masked sums instead of 12 masked inputs


def test_secure_edges_lost_mid_round_are_the_protocols_drop_outs() -> None:
    """An edge fails at a seeded stage of the protocol: its 4 clients drop out there (before their
    keys went up, or after they masked but before the edge's sum reached the root), the root
    recovers them as drop-outs and applies the other 8; two edges lost at once leave 4 of 12
    clients, below the threshold of 7: that round aborts and the model stays."""
    sim = InProcessSimulation.from_config(
        load_config(None, [*HUNDRED, *TWELVE, *SECURE, "hierarchy.edges=3", "hierarchy.edge_failure=0.5"])
    )
    seen = []
    for _ in range(5):
        before = sim.global_params.clone()
        sim.run_round()
        lost = dict(sim.runner.lost_stage) if sim.runner.lost else {}
        seen.append((sim.rounds.version, lost, len(sim.runner.reported)))
        if len(lost) == 2:
            assert torch.equal(sim.global_params, before)
    assert seen == [
        (1, {}, 3),
        (2, {"edge-000": "advertise"}, 2),
        (3, {"edge-002": "masked"}, 2),
        (3, {"edge-000": "advertise", "edge-002": "advertise"}, 0),
        (4, {"edge-000": "masked"}, 2),
    ]


def test_secure_edges_refuse_edge_rounds_and_the_malicious_variant() -> None:
    for extra, why in (
        ("hierarchy.edge_rounds=2", "edge_rounds = 2"),
        ("secure_aggregation.malicious_server=true", "consistency round through edges is not built"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config(None, [*HUNDRED, *SECURE, "hierarchy.edges=4", "secure_aggregation.threshold=0.7", extra])


def test_the_link_model_prices_each_round_through_edges_and_flat() -> None:
    """hierarchy.link_latency_s and *_mbps: each record has the round's modelled communication time
    through the edges and flat, from the bytes the round measured (simulations/link_time.py)."""
    from shoal.simulations.link_time import EdgeTraffic, LinkModel, flat_round_s, tree_round_s

    # by hand: 2 edges of 10 clients, 1 MB model, 0.1 MB updates, 2 MB partials; 10 ms a hop
    m = LinkModel(latency_s=0.01, root_mbps=80.0, edge_mbps=800.0, client_mbps=8.0)
    edges = [EdgeTraffic(10, (1_000_000, 900_000), 2_000_000), EdgeTraffic(10, (1_000_000,), 2_000_000)]
    # down: 2 MB at the root's 10 MB/s; edge 0's two cycles, each 1 MB to a client at 1 MB/s and 0.1 MB
    # (0.09 in the second) back; up: 4 MB of partials at the root's 10 MB/s; 6 hops of 10 ms
    assert tree_round_s(m, 1_000_000, edges) == pytest.approx(0.2 + (1.0 + 0.1) + (1.0 + 0.09) + 0.4 + 0.06)
    # flat: 20 MB of models and 2 MB of updates through the root's 10 MB/s, 2 hops
    assert flat_round_s(m, 1_000_000, 20, 2_000_000) == pytest.approx(2.0 + 0.2 + 0.02)
    assert not LinkModel().enabled and tree_round_s(m, 1, []) == 0.0

    links = ("hierarchy.root_mbps=8", "hierarchy.link_latency_s=0.05")
    sim = run("hierarchy.edges=4", "hierarchy.edge_rounds=2", *links, rounds=1)
    rec = sim.runner.round_fields()  # type: ignore[attr-defined]
    b = {k: rec[f"hier_bytes_{k}"] for k in ("edge_root_down", "edge_root_up", "client_edge_down")}
    model = b["edge_root_down"] / 4
    # only the root's link is limited (1 MB/s): the tree's root carries 4 models and 4 partials
    assert rec["hier_comm_s"] == pytest.approx((4 * model + b["edge_root_up"]) / 1e6 + 6 * 0.05)
    # flat, the root carries 100 models and the first edge round's 100 updates
    first_up = rec["hier_bytes_client_edge_up"] / 2  # two edge rounds of the same clients, dense updates
    assert rec["hier_comm_flat_s"] == pytest.approx((100 * model + first_up) / 1e6 + 2 * 0.05, rel=1e-3)
    assert rec["hier_comm_flat_s"] > 1.5 * rec["hier_comm_s"]  # the root's link is the bottleneck
    with pytest.raises(ConfigError, match="hierarchy.edges = 0 has none"):
        load_config(None, [*HUNDRED, *links])
    with pytest.raises(ConfigError, match="secure aggregation's stages"):
        load_config(None, [*HUNDRED, "hierarchy.edges=2", "secure_aggregation.enabled=true", *links])
