"""An edge's round (server/edge/rounds.py, without I/O) with the root's ServerService: two edges give the
flat model, a retransmit counts once, an edge closes at its quorum by weight or before the root's
deadline, and a dead edge is the drop-out of its nodes."""

from __future__ import annotations

import pytest
import torch

from shoal.aggregation.partial import encode_partial
from shoal.errors import UpdateRejected
from shoal.server.edge.intake import PartialIntake
from shoal.server.edge.rounds import EdgeRound, Retransmit
from shoal.server.service import ServerService
from shoal.update import Update
from shoal.wire import encode_update

from ..server.live import small_config

EDGE_NAMES = {"hierarchy": {"edge_names": ["edge-a", "edge-b", "edge-c", "edge-d", "edge-e", "edge-f"]}}

NODES = [f"n{i}" for i in range(10)]
EDGES = {"edge-a": NODES[:6], "edge-b": NODES[6:]}


def root(tmp_path, **server) -> tuple[ServerService, dict[str, dict]]:
    opts = {"clients_per_round": 10, "min_nodes": 10, "rounds": 3, "deadline_s": 60.0, **server}
    svc = ServerService.from_config(small_config(tmp_path, EDGE_NAMES, **opts))
    for n in NODES:
        svc.seen(n, 0.0)
    assert svc.tick(0.0)
    return svc, {n: svc.poll(n, 0.0) or {} for n in NODES}


def with_edges(tmp_path, **server) -> tuple[ServerService, dict[str, dict], PartialIntake]:
    """A root whose nodes are connected through the edges (each edge named its nodes in its poll)."""
    opts = {"clients_per_round": 10, "min_nodes": 10, "rounds": 3, "deadline_s": 60.0, **server}
    svc = ServerService.from_config(small_config(tmp_path, EDGE_NAMES, **opts), tier=PartialIntake)
    intake = svc.tier
    for name, nodes in EDGES.items():
        assert intake.poll(name, {"nodes": nodes}, NODES.__contains__, 0.0)["status"] == "wait"
    assert svc.tick(0.0)
    tasks = {}
    for name, nodes in EDGES.items():
        answer = intake.poll(name, {"nodes": nodes}, NODES.__contains__, 0.0)
        assert answer["status"] == "work" and sorted(answer["tasks"]) == sorted(nodes)
        tasks.update({n: {"round": answer["round"], "version": answer["version"]} for n in nodes})
    return svc, tasks, intake


def update(svc: ServerService, node: str, work: dict) -> Update:
    g = torch.Generator().manual_seed(int(node[1:]))
    return Update(torch.randn(svc.spec.numel, generator=g) * 0.01, 4 + int(node[1:]), work["version"], node)


def edge_round(svc: ServerService, name: str, works: dict, **kw) -> EdgeRound:
    w = next(iter(works.values()))
    return EdgeRound(name, w["round"], w["version"], svc.spec.numel, EDGES[name], **kw)


def test_two_edges_equal_flat_and_the_retransmit_counts_once(tmp_path) -> None:
    flat, works = root(tmp_path / "flat")
    for n in NODES:
        flat.submit(n, encode_update(update(flat, n, works[n]), flat.spec, {"round": works[n]["round"]}), 1.0)
    assert flat.tick(2.0) and flat.version == 1

    svc, works, intake = with_edges(tmp_path / "tree")
    for name in EDGES:
        edge = edge_round(svc, name, works)
        for n in EDGES[name]:
            assert not edge.should_close(1.0)
            edge.submit(n, update(svc, n, works[n]))
        assert edge.should_close(1.0)  # every node reported
        body = encode_partial(edge.close(), svc.spec.hash)
        retry = Retransmit(1.0, give_up_at=60.0)
        answers = []
        while retry.due(1.0 + retry.attempts) and retry.attempts < 2:  # the first answer was "lost"
            retry.sent(1.0 + retry.attempts)
            answers.append(intake.submit(name, body, 1.0 + retry.attempts)["status"])
        retry.answered()
        assert answers == ["accepted", "duplicate"] and not retry.due(100.0)
    assert svc.tick(3.0) and svc.version == 1
    torch.testing.assert_close(svc.rounds.global_params, flat.rounds.global_params, atol=1e-6, rtol=0)


def test_quorum_by_weight_and_the_deadline_margin(tmp_path) -> None:
    svc, works = root(tmp_path)
    expected = {n: float(4 + int(n[1:])) for n in EDGES["edge-a"]}  # the weights it saw last round
    edge = edge_round(svc, "edge-a", works, quorum=0.5, expected=expected, deadline_at=60.0, margin_s=5.0)
    total = sum(expected.values())
    for n in reversed(EDGES["edge-a"]):  # the heaviest first
        edge.submit(n, update(svc, n, works[n]))
        if edge.acc.total_weight >= 0.5 * total:
            break
        assert not edge.should_close(10.0)
    assert edge.should_close(10.0) and 0 < edge.acc.count < 6
    part = edge.close()
    assert part is not None and part.origin == "edge-a" and part.count == edge.acc.count
    with pytest.raises(UpdateRejected) as e:
        edge.submit("n0", update(svc, "n0", works["n0"]))
    assert e.value.code == "round_closed"

    slow = edge_round(svc, "edge-b", works, deadline_at=60.0, margin_s=5.0)
    slow.submit("n6", update(svc, "n6", works["n6"]))
    assert not slow.should_close(54.9) and slow.should_close(55.0)  # the margin before the root's deadline
    with pytest.raises(UpdateRejected) as e:
        slow.submit("n0", update(svc, "n0", works["n0"]))  # not one of its nodes
    assert e.value.code == "not_selected"
    with pytest.raises(UpdateRejected) as e:
        slow.submit("n6", update(svc, "n6", works["n6"]))  # twice
    assert e.value.code == "duplicate"
    assert edge_round(svc, "edge-b", works).close() is None  # nothing arrived: nothing to send
    retry = Retransmit(0.0, give_up_at=60.0)
    retry.sent(0.0)
    assert not retry.due(0.4) and retry.due(0.5)
    retry.sent(0.5)
    assert not retry.due(1.4) and retry.due(1.5) and not retry.due(61.0)


def test_a_dead_edge_is_the_drop_out_of_its_nodes(tmp_path) -> None:
    svc, works, intake = with_edges(tmp_path, min_fraction=0.5)
    edge = edge_round(svc, "edge-a", works)
    for n in EDGES["edge-a"]:
        edge.submit(n, update(svc, n, works[n]))
    intake.submit("edge-a", encode_partial(edge.close(), svc.spec.hash), 1.0)
    assert not svc.tick(30.0)  # edge-b's nodes are still awaited
    assert svc.tick(61.0) and svc.version == 1  # the root's deadline: 6 of 10 results (>= min_fraction)
    record = svc.events[-1].fields
    assert record["num_results"] == 6

    only_a, works = root(tmp_path / "flat", min_fraction=0.5)
    for n in EDGES["edge-a"]:
        only_a.submit(n, encode_update(update(only_a, n, works[n]), only_a.spec, {"round": works[n]["round"]}), 1.0)
    assert only_a.tick(61.0)
    torch.testing.assert_close(svc.rounds.global_params, only_a.rounds.global_params, atol=1e-6, rtol=0)


def test_the_root_stops_waiting_for_the_nodes_an_edge_closed_out(tmp_path) -> None:
    """An edge that closed at its quorum sends one partial: the root counts its other nodes as
    answered for this round and closes before its deadline once the other edge reported."""
    svc, works, intake = with_edges(tmp_path, min_fraction=0.5)
    expected = {n: float(4 + int(n[1:])) for n in EDGES["edge-a"]}
    a = edge_round(svc, "edge-a", works, quorum=0.5, expected=expected)
    for n in reversed(EDGES["edge-a"]):
        a.submit(n, update(svc, n, works[n]))
        if a.should_close(1.0):
            break
    part = a.close()
    assert part is not None and 0 < part.count < 6
    intake.submit("edge-a", encode_partial(part, svc.spec.hash), 1.0)
    assert not svc.tick(2.0)  # edge-b's nodes are still awaited
    b = edge_round(svc, "edge-b", works)
    for n in EDGES["edge-b"]:
        b.submit(n, update(svc, n, works[n]))
    intake.submit("edge-b", encode_partial(b.close(), svc.spec.hash), 3.0)
    assert svc.tick(3.0) and svc.version == 1  # long before the deadline (60 s)
    assert svc.events[-1].fields["num_results"] == part.count + 4
