"""HierFAVG's edge rounds at an edge process (``hierarchy.edge_rounds``): what an edge refuses, and
its state without sockets running the edge rounds of one root round. The processes themselves
(a root, two edges, nodes; the root's model against the simulator's HierFAVG model) are in
test_edge_process.py."""

from __future__ import annotations

import pytest

from shoal.config import config_from_dict
from shoal.errors import ConfigError, ShoalError


def test_an_edge_refuses_edge_rounds_under_an_async_root_or_secure_aggregation() -> None:
    base = {"data": {"dataset": "synthetic"}, "model": {"name": "logreg"}}
    for extra, words in (
        ({"server": {"mode": "async"}}, "an async root has no rounds"),
        (
            {"secure_aggregation": {"enabled": True, "threshold": 0.7, "keys_file": "k"}},
            "edge round needs the edge's own mean",
        ),
        ({"hierarchy": {"edge_rounds": 5000}}, "at most 4096 edge rounds"),
    ):
        hier = {"parent": "http://r:1", "edge_rounds": 2, **extra.get("hierarchy", {})}
        with pytest.raises(ConfigError, match=words):
            config_from_dict({**base, **extra, "hierarchy": hier}).validate()


def test_the_edge_state_runs_its_edge_rounds_and_sends_one_partial(tmp_path) -> None:
    """EdgeNodes without sockets, 3 nodes, 2 edge rounds: edge round 2's tasks come with the edge's
    model under an edge version and derived seeds, a node that missed edge round 1 trains in edge
    round 2, one that misses edge round 2 is its drop-out, and the partial for the root is
    ``sum_i w_i delta_i + W_e (x_e - x)`` of the root's round and version."""
    import torch

    from shoal.seeding import derive_seed
    from shoal.server.edge.rounds import EDGE_ROUND_STREAM, edge_version
    from shoal.server.edge.service import EdgeNodes, edge_spec
    from shoal.server.service import ModelDownload
    from shoal.update import Update
    from shoal.wire import decode_model, encode_model, encode_update

    from ..server.live import small_config

    cfg = small_config(tmp_path, {"hierarchy": {"parent": "http://127.0.0.1:1", "edge_rounds": 2}})
    e = EdgeNodes(cfg, edge_spec(cfg))
    n = e.spec.numel
    seeds = {"n0": 11, "n1": 12, "n2": 13}
    assert e.from_root(
        {"edge": "edge-a", "status": "work", "round": 3, "version": 2, "tasks": seeds, "deadline_s": 30}, 0.0
    )
    assert e.round is not None and e.round.close_at == pytest.approx((30.0 - cfg.hierarchy.edge_margin_s) / 2)
    x = torch.linspace(-1, 1, n)
    e.took_model(ModelDownload(2, '"root-v2"', b"", memoryview(bytearray(encode_model(x, e.spec, 2)))))

    def delta(node: str, k: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(10 * k + int(node[1:]))) * 0.01

    def send(node: str, version: int, k: int, examples: int) -> None:
        u = Update(delta(node, k), examples, version, node)
        assert (
            e.submit(node, memoryview(bytearray(encode_update(u, e.spec, {"round": 3}))), 1.0)["status"] == "accepted"
        )

    assert e.poll("n0", 0.5)["seed"] == 11  # edge round 1: the root's model and seeds
    send("n0", 2, 0, 4)
    send("n1", 2, 0, 6)
    e.failed("n2", b'{"round": 3, "version": 2, "reason": "diverged"}', 1.0)
    assert e.round.should_close(1.0)
    part, opened = e.close_round(1.0)
    assert part is None and opened
    v = edge_version(2, 1)
    x_e = x + (4 * delta("n0", 0).double() + 6 * delta("n1", 0).double()).div(10).float()
    task = e.poll("n2", 1.1)  # edge round 2: all three nodes again, from the edge's model
    assert task is not None and (task["round"], task["version"]) == (3, v)
    assert task["seed"] == derive_seed(13, EDGE_ROUND_STREAM, 1)
    assert e.model is not None and e.model.version == v and e.model.etag != '"root-v2"'
    served = decode_model(bytes(e.model.head) + bytes(e.model.data), e.spec)[0]
    torch.testing.assert_close(served, x_e, atol=0, rtol=0)
    assert e.version == 2  # the root's version, not the edge's
    assert e.from_root({"edge": "edge-a", "status": "work", "round": 3, "version": 2, "tasks": seeds}, 1.2) is False
    with pytest.raises(ShoalError) as err:  # an update of edge round 1 is late now
        send("n1", 2, 0, 6)
    assert err.value.code == "stale"
    send("n2", v, 1, 5)
    send("n0", v, 1, 4)
    assert not e.round.should_close(2.0)  # n1 has until the root's deadline less the margin
    assert e.round.should_close(30.0 - cfg.hierarchy.edge_margin_s)  # n1 missed edge round 2: its drop-out
    part, opened = e.close_round(30.0)
    assert part is not None and not opened
    assert (part.round, part.version, part.senders, part.total_weight) == (3, 2, {"n0", "n2"}, 9.0)
    want = 5 * delta("n2", 1).double() + 4 * delta("n0", 1).double() + 9 * (x_e.double() - x.double())
    torch.testing.assert_close(part.weighted_sum, want, atol=1e-12, rtol=0)
