"""Edges under an async (FedBuff) root: a partial of k nodes counts k toward the buffer, each node's
staleness is its base version's, and the root's model equals flat FedBuff's fed the same updates in
the same order; retransmits count once, foreign and too stale partials change nothing."""

from __future__ import annotations

import pytest
import torch

from shoal.aggregation.partial import encode_partial
from shoal.errors import UpdateRejected
from shoal.server.edge.intake import PartialIntake
from shoal.server.edge.rounds import EdgeBuffer
from shoal.server.service import ServerService
from shoal.server.store import ServerStore, open_service
from shoal.update import Update
from shoal.wire import encode_update

from ..server.live import small_config

NODES = [f"n{i}" for i in range(8)]


def root(tmp_path, k: int = 4, max_staleness: int = 3) -> ServerService:
    sections = {
        "hierarchy": {"edge_names": ["edge-a", "edge-b"]},
        "asynchronous": {
            "algorithm": "fedbuff",
            "buffer_size": k,
            "max_staleness": max_staleness,
            "staleness_weight": "polynomial",
        },
        "strategy": {"weighting": "examples"},
    }
    return ServerService.from_config(
        small_config(tmp_path, sections, mode="async", rounds=50, min_nodes=1), tier=PartialIntake
    )


def node_update(svc: ServerService, node: str, version: int) -> Update:
    i = int(node[1:])
    g = torch.Generator().manual_seed(100 * version + i)
    delta = torch.randn(svc.spec.numel, generator=g) * 0.01
    return Update(delta, 5 + 3 * i, version, node, {"train_loss": 0.5})


def flat_submit(svc: ServerService, node: str, version: int) -> None:
    body = encode_update(node_update(svc, node, version), svc.spec, {"round": version})
    assert svc.submit(node, body, 1.0)["status"] == "accepted"


def edge_tasks(intake: PartialIntake, edge: str, nodes: list[str], buf: EdgeBuffer) -> int:
    """The edge names ``nodes`` as waiting for a task; the root hands out one each (its version)."""
    answer = intake.poll(edge, {"nodes": nodes, "want": nodes}, lambda n: True, 0.5)
    assert answer["status"] == "work" and sorted(answer["tasks"]) == sorted(nodes)
    buf.edge = answer["edge"]
    buf.given(answer["tasks"], answer["version"])
    return answer["version"]


def send(svc: ServerService, intake: PartialIntake, edge: str, buf: EdgeBuffer, now: float = 2.0) -> list[bytes]:
    bodies = [encode_partial(p, svc.spec.hash, "float32") for p in buf.flush()]
    for b in bodies:
        assert intake.submit(edge, b, now)["status"] == "accepted"
    return bodies


def test_edge_partials_give_flat_fedbuff_with_staleness(tmp_path) -> None:
    flat = root(tmp_path / "flat")
    for n in NODES:
        assert flat.poll(n, 0.0)["version"] == 0  # type: ignore[index]
    for n in NODES[:4]:
        flat_submit(flat, n, 0)
    assert flat.version == 1
    for n in NODES[4:]:  # trained from version 0: staleness 1
        flat_submit(flat, n, 0)
    assert flat.version == 2

    svc = root(tmp_path / "root")
    intake = svc.tier
    a = EdgeBuffer("", svc.spec.numel, size=2)
    b = EdgeBuffer("", svc.spec.numel, size=4)
    assert edge_tasks(intake, "edge-a", NODES[:4], a) == 0
    assert edge_tasks(intake, "edge-b", NODES[4:], b) == 0
    for n in NODES[:2]:
        a.submit(n, node_update(svc, n, 0), 1.0)
    assert a.should_flush(1.0) and not b.should_flush(1.0)
    (first,) = send(svc, intake, "edge-a", a)
    assert svc.version == 0  # 2 of K = 4
    for n in NODES[2:4]:
        a.submit(n, node_update(svc, n, 0), 1.0)
    send(svc, intake, "edge-a", a)
    assert svc.version == 1  # 2 partials of 2 nodes: K = 4 updates
    for n in NODES[4:]:
        b.submit(n, node_update(svc, n, 0), 1.5)
    (late,) = send(svc, intake, "edge-b", b)
    assert svc.version == 2  # one partial of 4 nodes, each 1 version stale
    torch.testing.assert_close(svc.rounds.global_params, flat.rounds.global_params, atol=1e-6, rtol=0)
    assert svc.counters.accepted == flat.counters.accepted == 8
    assert svc.rounds.stats.staleness == flat.rounds.stats.staleness == {0: 4, 1: 4}  # type: ignore[attr-defined]
    assert svc.rounds.stats.examples == flat.rounds.stats.examples  # type: ignore[attr-defined]
    record = svc.events[-1].fields
    assert (record["hier_edges_reporting"], record["hier_nodes_via_edges"]) == (1, 4)
    assert record["hier_bytes_edge_root_up"] == len(late)

    # a retransmit of a partial already taken: answered as a duplicate, counted once
    before = svc.rounds.global_params.clone()
    assert intake.submit("edge-a", first, 3.0)["status"] == "duplicate"
    assert svc.counters.accepted == 8 and svc.version == 2
    torch.testing.assert_close(svc.rounds.global_params, before, atol=0, rtol=0)


def test_a_partial_crossing_k_enters_whole(tmp_path) -> None:
    """K = 4 and two partials of 3: the buffer takes all 6 (a sum cannot be split): the step equals
    flat FedBuff's with K = 6 over the same updates."""
    flat = root(tmp_path / "flat", k=6)
    for n in NODES[:6]:
        flat.poll(n, 0.0)
    for n in NODES[:6]:
        flat_submit(flat, n, 0)
    svc = root(tmp_path / "root", k=4)
    intake = svc.tier
    a = EdgeBuffer("", svc.spec.numel, size=3)
    edge_tasks(intake, "edge-a", NODES[:6], a)
    for n in NODES[:3]:
        a.submit(n, node_update(svc, n, 0), 1.0)
    send(svc, intake, "edge-a", a)
    for n in NODES[3:6]:
        a.submit(n, node_update(svc, n, 0), 1.0)
    send(svc, intake, "edge-a", a)
    assert svc.version == flat.version == 1
    torch.testing.assert_close(svc.rounds.global_params, flat.rounds.global_params, atol=1e-6, rtol=0)


def test_foreign_stale_and_hostile_partials_change_nothing(tmp_path) -> None:
    svc = root(tmp_path, k=2, max_staleness=1)
    intake = svc.tier
    a = EdgeBuffer("", svc.spec.numel, size=8)
    b = EdgeBuffer("", svc.spec.numel, size=8)
    edge_tasks(intake, "edge-a", NODES[:4], a)
    edge_tasks(intake, "edge-b", NODES[4:], b)
    for n in NODES[:4]:
        a.submit(n, node_update(svc, n, 0), 1.0)
    (held,) = a.flush()

    def refused(edge: str, body: bytes, code: str) -> None:
        before = (svc.version, svc.counters.accepted, svc.rounds.global_params.clone())
        with pytest.raises(UpdateRejected) as e:
            intake.submit(edge, body, 2.0)
        assert e.value.code == code
        assert (svc.version, svc.counters.accepted) == before[:2]
        torch.testing.assert_close(svc.rounds.global_params, before[2], atol=0, rtol=0)

    body = encode_partial(held, svc.spec.hash)
    refused("edge-b", body, "not_your_node")  # edge-a's nodes, sent by edge-b
    with pytest.raises(UpdateRejected) as e:
        intake.submit("n0", body, 2.0)
    assert e.value.code == "not_an_edge"
    # edge-b's nodes move the root two versions on: edge-a's partial of version 0 is then too stale
    for n in NODES[4:]:
        b.submit(n, node_update(svc, n, 0), 1.0)
    for p in b.flush():
        intake.submit("edge-b", encode_partial(p, svc.spec.hash), 2.0)
    assert svc.version == 1  # 4 updates, one partial: K = 2 overshot, one step
    edge_tasks(intake, "edge-b", NODES[4:], b)
    for n in NODES[4:]:
        b.submit(n, node_update(svc, n, 1), 1.0)
    for p in b.flush():
        intake.submit("edge-b", encode_partial(p, svc.spec.hash), 2.0)
    assert svc.version == 2
    refused("edge-a", body, "too_stale")  # 2 versions behind, max_staleness = 1
    assert svc.counters.accepted == 8
    assert svc.rounds.stats.rejected == {"too_stale": 1}  # type: ignore[attr-defined]
    assert not any(n in svc.rounds.outstanding for n in NODES[:4])  # type: ignore[attr-defined]  # tasks closed


def test_a_restarted_root_takes_the_partials_of_tasks_it_handed_out_before(tmp_path) -> None:
    """The root's checkpoint keeps which edge handed out each open task: after a restart, the
    edge's partial of those nodes counts (it was refused whole as not_your_node before), while a
    task handed out after the checkpoint is gone with the rest of that lost state."""
    cfg = root(tmp_path, k=2).cfg
    svc = open_service(cfg, started_at=0.0)
    intake = svc.tier
    a = EdgeBuffer("", svc.spec.numel, size=4)
    b = EdgeBuffer("", svc.spec.numel, size=2)
    edge_tasks(intake, "edge-a", NODES[:4], a)
    edge_tasks(intake, "edge-b", NODES[4:6], b)
    for n in NODES[4:6]:
        b.submit(n, node_update(svc, n, 0), 1.0)
    send(svc, intake, "edge-b", b)
    assert svc.version == 1  # a checkpoint with edge-a's four open tasks in it
    edge_tasks(intake, "edge-b", NODES[6:], b)  # after the checkpoint: lost in the crash

    again = ServerService.from_config(cfg, restored=ServerStore(cfg).restore(resume=True), tier=PartialIntake)
    assert again.version == 1
    intake2 = again.tier
    assert intake2.task_via == {n: "edge-a" for n in NODES[:4]}
    for n in NODES[:4]:
        a.submit(n, node_update(again, n, 0), 1.0)
    (part,) = a.flush()
    answer = intake2.submit("edge-a", encode_partial(part, again.spec.hash), 2.0)
    assert answer["status"] == "accepted" and answer["nodes"] == 4 and again.version == 2
    for n in NODES[6:]:
        b.submit(n, node_update(again, n, 1), 1.0)
    (late,) = b.flush()
    with pytest.raises(UpdateRejected) as e:
        intake2.submit("edge-b", encode_partial(late, again.spec.hash), 2.0)
    assert e.value.code == "not_your_node" and again.version == 2


def test_edge_buffer_flushes_by_size_time_and_version() -> None:
    buf = EdgeBuffer("edge-a", 3, size=3, wait_s=1.0)
    assert buf.asks("n0") is None and buf.want == {"n0"}
    buf.given({"n0": 11, "n1": 12}, 4)
    buf.given({"n2": 13}, 5)
    assert buf.want == set() and buf.asks("n0") == (4, 11)
    with pytest.raises(UpdateRejected) as e:
        buf.submit("n0", Update(torch.ones(3), 2, 5, "n0"), 0.0)
    assert e.value.code == "bad_version"
    buf.submit("n0", Update(torch.ones(3), 2, 4, "n0"), 0.0)
    with pytest.raises(UpdateRejected):
        buf.submit("n0", Update(torch.ones(3), 2, 4, "n0"), 0.1)  # its task is used
    buf.submit("n2", Update(torch.ones(3), 1, 5, "liar"), 0.2)
    assert not buf.should_flush(0.9) and buf.should_flush(1.0)  # the oldest waited wait_s
    parts = buf.flush()
    assert [(p.version, sorted(p.senders), p.origin) for p in parts] == [(4, ["n0"], "edge-a"), (5, ["n2"], "edge-a")]
    assert buf.count == 0 and not buf.should_flush(5.0)
    assert buf.drop("n1", 4) and not buf.drop("n1", 4)


def test_a_node_with_an_update_on_its_way_gets_no_new_task_until_the_root_answered() -> None:
    """The root holds one open task per node: a new one would replace the task the buffered update
    belongs to (and the root would refuse that partial whole)."""
    buf = EdgeBuffer("edge-a", 3, size=1)
    buf.given({"n0": 1}, 0)
    assert buf.asks("n0") == (0, 1)
    buf.deliver("n0")
    buf.submit("n0", Update(torch.ones(3), 2, 0, "n0"), 0.0)
    assert buf.asks("n0") is None and "n0" not in buf.want  # buffered: held back
    (part,) = buf.flush()
    assert buf.asks("n0") is None and "n0" not in buf.want  # on its way to the root: held back
    assert buf.answered(part) and buf.want == {"n0"}  # answered: it waits for its next task
    buf.given({"n0": 2}, 1)
    assert buf.asks("n0") == (1, 2)
    buf.deliver("n0")
    assert buf.asks("n0") is None and buf.want == {"n0"}  # asked again after delivery: gave the task up
    assert "n0" not in buf.tasks
