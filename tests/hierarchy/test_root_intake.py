"""The root's intake of edge partials (server/edge/intake.py): two edges' partials give the flat round's
model, a retransmit counts once, conflicts, double counting, unselected nodes and hostile bodies
are refused with nothing changed."""

from __future__ import annotations

import pytest
import torch

from shoal.aggregation.partial import Accumulator, encode_partial
from shoal.errors import ShoalError, UpdateRejected
from shoal.server.edge.intake import PartialIntake, edge_terms
from shoal.server.service import ServerService
from shoal.update import Update
from shoal.wire import encode_update

from ..server.live import small_config

EDGE_NAMES = {"hierarchy": {"edge_names": ["edge-a", "edge-b", "edge-c", "edge-d", "edge-e", "edge-f"]}}

NODES = [f"n{i}" for i in range(8)]


def open_round(tmp_path, edges: dict[str, list[str]] | None = None) -> tuple[ServerService, list[dict], PartialIntake]:
    """A root with a round open over NODES; ``edges``: each edge named its nodes (POST /v1/edge/poll)
    before the round opened, so the root lets it speak for them in this round."""
    svc = ServerService.from_config(
        small_config(tmp_path, EDGE_NAMES, clients_per_round=8, min_nodes=8, rounds=3), tier=PartialIntake
    )
    intake = svc.tier
    for edge, nodes in (edges or {}).items():
        assert intake.poll(edge, {"nodes": nodes}, NODES.__contains__, 0.0)["status"] == "wait"
    for n in NODES:
        svc.seen(n, 0.0)
    assert svc.tick(0.0)
    return svc, [dict(svc.poll(n, 0.0) or {}, node=n) for n in NODES], intake


def node_update(svc: ServerService, work: dict) -> Update:
    g = torch.Generator().manual_seed(int(work["node"][1:]))
    delta = torch.randn(svc.spec.numel, generator=g) * 0.01
    return Update(delta, 5 + int(work["node"][1:]) * 3, work["version"], work["node"], {"train_loss": 0.5})


def edge_body(svc: ServerService, works: list[dict], origin: str = "edge-a") -> bytes:
    acc = Accumulator(works[0]["round"], works[0]["version"], svc.spec.numel)
    for w in works:
        acc.add_update(node_update(svc, w))
    return encode_partial(acc.partial().sealed(origin), svc.spec.hash, "float32")


def test_two_edges_give_the_flat_round_and_retransmits_count_once(tmp_path) -> None:
    flat, works, _ = open_round(tmp_path / "flat")
    for w in works:
        flat.submit(w["node"], encode_update(node_update(flat, w), flat.spec, {"round": w["round"]}), 1.0)
    assert flat.tick(2.0) and flat.version == 1

    root, works, intake = open_round(tmp_path / "root", {"edge-a": NODES[:5], "edge-b": NODES[5:]})
    a, b = edge_body(root, works[:5]), edge_body(root, works[5:], origin="liar")  # the body's origin is ignored
    assert intake.submit("edge-a", a, 1.0)["status"] == "accepted"
    assert intake.submit("edge-a", a, 1.1)["status"] == "duplicate"  # a retransmit: counted once
    assert intake.submit("edge-b", b, 1.2) == {"status": "accepted", "round": 1, "version": 0, "nodes": 3}
    assert root.counters.accepted == 8
    root.clock.usage = lambda: (12.5, 300.04)  # CPU seconds and resident MB of the process
    assert root.tick(2.0) and root.version == 1  # every selected node is in: the round closes
    torch.testing.assert_close(root.rounds.global_params, flat.rounds.global_params, atol=1e-6, rtol=0)
    record = root.events[-1].fields
    # the root's cost of the version: seconds since the run started (at the first call, 0.0), its
    # resident memory; CPU seconds from the second version on (the first has no earlier reading)
    assert (record["server_round_s"], record["server_rss_mb"], "server_cpu_s" in record) == (2.0, 300.0, False)
    assert record["hier_nodes_reattached"] == 0
    assert record["num_results"] == 8 and record["num_examples"] == sum(5 + 3 * i for i in range(8))
    assert (record["hier_edges_reporting"], record["hier_nodes_via_edges"]) == (2, 8)
    assert record["hier_bytes_edge_root_up"] == len(a) + len(b)  # the retransmit was not taken again
    with pytest.raises(UpdateRejected) as e:
        intake.submit("edge-a", a, 3.0)  # the round it belonged to is over
    assert e.value.code in ("round_closed", "stale")


def test_conflicts_double_counting_and_hostile_bodies_change_nothing(tmp_path) -> None:
    root, works, intake = open_round(tmp_path, {"edge-a": NODES[:5], "edge-b": NODES[5:7], "edge-d": NODES[7:]})
    intake.submit("edge-a", edge_body(root, works[:3]), 1.0)
    root.submit("n5", encode_update(node_update(root, works[5]), root.spec, {"round": works[5]["round"]}), 1.0)
    before = root.sync.strategy.aggregator._sum.clone()  # type: ignore[union-attr]
    attempts = [
        ("edge-a", edge_body(root, works[3:5]), "conflict"),  # another partial from edge-a this round
        ("edge-b", edge_body(root, works[2:5]), "not_your_node"),  # n2..n4 are edge-a's (n2 is already in)
        ("edge-b", edge_body(root, works[5:7]), "duplicate"),  # n5 sent its own update to the root
        ("edge-c", edge_body(root, [dict(works[5], node="n99")]), "not_your_node"),  # nobody's node
        ("edge-d", edge_body(root, [dict(works[7], version=7)]), "stale"),
        ("edge-e", b"\x00" * 40, "malformed"),
        ("n7", edge_body(root, works[6:]), "not_an_edge"),  # a node may not speak for others
        ("edge-f", edge_body(root, works[6:])[:-10], "malformed"),
    ]
    for edge, body, code in attempts:
        with pytest.raises(ShoalError) as e:
            intake.submit(edge, body, 1.5)
        assert getattr(e.value, "code", "") == code, (edge, e.value)
    assert torch.equal(root.sync.strategy.aggregator._sum, before)  # type: ignore[union-attr]
    assert root.sync.received == {"n0", "n1", "n2", "n5"}  # type: ignore[union-attr]
    # edge-b and edge-d, refused above, can still send good partials
    assert intake.submit("edge-b", edge_body(root, works[6:7]), 2.0)["status"] == "accepted"
    assert intake.submit("edge-d", edge_body(root, works[7:]), 2.0)["status"] == "accepted"
    assert root.sync.received == {"n0", "n1", "n2", "n5", "n6", "n7"}  # type: ignore[union-attr]


def test_the_root_decides_which_edge_speaks_for_a_node(tmp_path) -> None:
    """A claim counts only for enrolled nodes (never an edge), the first live edge holds a node, a
    silent edge loses its nodes after hierarchy.edge_timeout_s; a node that re-attached to another
    edge in the open round gets its task there (its dead edge cannot count it any more), and a round
    never selects a node that no live edge holds when it opens."""
    root = ServerService.from_config(
        small_config(tmp_path, EDGE_NAMES, clients_per_round=8, min_nodes=8, rounds=3), tier=PartialIntake
    )
    intake = root.tier
    enrolled = {*NODES, "edge-a", "edge-b"}
    revoked = {"n9"}.__contains__  # n9 was enrolled and revoked at the root; ghost never was
    a = intake.poll("edge-a", {"nodes": ["n0", "n1", "ghost", "edge-b", "n9"]}, enrolled.__contains__, 0.0, revoked)
    assert a["refused"] == {"ghost": "not_claimable", "edge-b": "not_claimable", "n9": "not_claimable"}
    assert a["nodes"] == 2
    assert a["revoked"] == ["n9"]  # the edge refuses it from this answer on; an unknown name is not revealed
    b = intake.poll("edge-b", {"nodes": ["n1", "n2"]}, enrolled.__contains__, 0.5)
    assert b["refused"] == {"n1": "not_claimable"}  # the same reason: no enrollment is revealed and b["nodes"] == 1
    for n in NODES[3:]:
        root.seen(n, 0.5)
    assert root.tick(0.5)  # n0..n2 are connected through the edges
    works = [dict(root.poll(n, 0.5) or {}, node=n) for n in NODES]
    assert sorted(intake.poll("edge-a", {"nodes": ["n0", "n1"]}, enrolled.__contains__, 1.0)["tasks"]) == ["n0", "n1"]
    timeout = root.cfg.hierarchy.edge_timeout_s
    later = 1.0 + timeout + 0.1  # edge-a fell silent: edge-b may claim its nodes, for the next rounds
    b = intake.poll("edge-b", {"nodes": ["n0", "n1", "n2"]}, enrolled.__contains__, later)
    assert "refused" not in b and sorted(b["tasks"]) == ["n0", "n1", "n2"]  # n0, n1 re-attached: their tasks
    assert b["tasks"]["n0"] == works[0]["seed"]  # the same task the root gave it through edge-a
    # the next version's record says two nodes moved, the longest 1.0 + timeout + 0.1 - 1.0 s after edge-a last named it
    moved = intake.figures(root.sync.round)  # type: ignore[union-attr]
    assert moved == {"hier_nodes_reattached": 2, "hier_reattach_s": pytest.approx(timeout + 0.1)}
    assert intake.figures(root.sync.round)["hier_nodes_reattached"] == 0  # type: ignore[union-attr]
    with pytest.raises(UpdateRejected) as e:  # edge-a is back with its old sum: not its nodes any more
        intake.submit("edge-a", edge_body(root, works[:2]), later)
    assert e.value.code == "not_your_node" and root.sync.received == set()  # type: ignore[union-attr]
    assert intake.submit("edge-b", edge_body(root, works[:3], origin="edge-b"), later)["status"] == "accepted"
    # the next round opens after edge-b fell silent too: nodes last named by an edge no longer live are
    # connected (heard from within poll_s + 5 s) but not selected; n3..n7 polled the root themselves
    for n in NODES[3:]:
        root.submit(n, encode_update(node_update(root, works[int(n[1:])]), root.spec, {"round": 1}), later)
    assert root.tick(later) and root.version == 1
    gone = later + timeout + 0.1
    for n in NODES[3:]:
        root.seen(n, gone)
    assert set(root.connected(gone)) == set(NODES)
    assert not root.tick(gone)  # 5 reachable nodes, below min_nodes = 8
    assert intake.poll("edge-a", {"nodes": ["n0", "n1", "n2"]}, enrolled.__contains__, gone)["status"] == "wait"
    assert root.tick(gone) and set(root.sync.selected) == set(NODES)  # type: ignore[union-attr]
    # n3 (no edge held it when the round opened) moves to edge-b, which sends its partial; then edge-a
    # falls silent and n0 re-attaches to edge-b: too late to be counted this round, the root stops
    # waiting for it rather than waiting out the deadline for an attached node
    works = [dict(root.poll(n, gone) or {}, node=n) for n in NODES]
    assert list(intake.poll("edge-b", {"nodes": ["n3"]}, enrolled.__contains__, gone)["tasks"]) == ["n3"]
    assert intake.submit("edge-b", edge_body(root, works[3:4], origin="edge-b"), gone)["status"] == "accepted"
    intake.poll("edge-b", {"nodes": ["n0", "n3"]}, enrolled.__contains__, gone + timeout + 0.1)
    assert root.refused_task["n0"] == (root.sync.round, root.sync.version)  # type: ignore[union-attr]
    for bad in ({"nodes": "n0"}, {"nodes": ["n0", "n0"]}, {"nodes": [""]}, {"nodes": [], "x": 1}, [1]):
        with pytest.raises(ShoalError) as e:
            intake.poll("edge-b", bad, enrolled.__contains__, later)
        assert e.value.code == "malformed"
    with pytest.raises(ShoalError) as e:
        intake.poll("n3", {"nodes": ["n4"]}, enrolled.__contains__, later)
    assert e.value.code == "not_an_edge"
    assert intake.roster.holder("n4", later) is None


def test_an_edge_whose_config_differs_holds_no_node_and_the_round_selects_none_of_them(tmp_path) -> None:
    """An edge names its config terms in every poll; one whose privacy mode differs from the root's
    is refused (409 ``config_mismatch``, one line naming the key), loses the nodes it held, the next
    round selects none of them, and the run's status says which edge and why, until it agrees."""
    root = ServerService.from_config(
        small_config(tmp_path, EDGE_NAMES, clients_per_round=8, min_nodes=4, rounds=3), tier=PartialIntake
    )
    intake = root.tier
    good = edge_terms(root.cfg)
    bad = {**good, "privacy.mode": "central"}
    assert intake.poll("edge-a", {"nodes": NODES[:4], "config": good}, NODES.__contains__, 0.0)["nodes"] == 4
    assert intake.poll("edge-b", {"nodes": NODES[4:], "config": good}, NODES.__contains__, 0.0)["nodes"] == 4
    with pytest.raises(UpdateRejected) as e:  # edge-b restarted with another [privacy] table
        intake.poll("edge-b", {"nodes": NODES[4:], "config": bad}, NODES.__contains__, 0.5)
    assert e.value.code == "config_mismatch" and str(e.value).startswith("privacy.mode: this edge runs 'central'")
    assert "\n" not in str(e.value)
    assert all(intake.roster.holder(n, 0.5) is None for n in NODES[4:])
    status = root.status(0.5)["hierarchy"]
    assert status["edges_refused"] == {"edge-b": str(e.value)} and status["edges_live"] == ["edge-a"]
    assert root.tick(0.6)  # n4..n7 were last named by edge-b: connected, but no live edge can reach them
    assert set(root.sync.selected) == set(NODES[:4])  # type: ignore[union-attr]
    for terms in ({"privacy.mode": 1}, ["x"]):
        with pytest.raises(ShoalError) as e:
            intake.poll("edge-c", {"nodes": [], "config": terms}, NODES.__contains__, 0.7)
    assert intake.poll("edge-b", {"nodes": NODES[4:], "config": good}, NODES.__contains__, 1.0)["nodes"] == 4
    assert list(root.status(1.0)["hierarchy"]["edges_refused"]) == ["edge-c"]  # edge-b agrees now
