"""An edge process SIGKILLed in the middle of a round and started again keeps the updates it had
taken: they are on disk (the edge's journal) before a node hears "accepted", and the restarted edge
takes them back into its sum, so the root counts them. Real processes on 127.0.0.1: a root, one
edge and four nodes in two node hosts; one node never uploads (the edge waits for it, which leaves
the time to kill), and its host goes down with the edge (so the restarted edge does not wait for it
again). Bounded: every wait has a timeout and every process is killed at the end."""

from __future__ import annotations

import stat
import time

import pytest

from .deploy import hierarchy

DEADLINE_S = 30.0  # the root's: the edge must be back (a process start) before it, minus edge_margin_s


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_restarted_edge_takes_back_the_round_s_updates(tmp_path):
    with hierarchy(tmp_path, n=4, edges=1, rounds=1, deadline=DEADLINE_S) as h:
        h.start_servers()  # the root and edge-a
        silent = h.shards[3].stem  # in host-1, with node 1 (host k holds nodes k, k + 2)
        kept, gone = h.hosts(2, silent=[silent])
        end = time.monotonic() + 120
        while sum(e["outcome"] == "accepted" for e in h.events()) < 3:  # the three others' uploads are in
            assert time.monotonic() < end, h.dump()
            time.sleep(0.05)
        h.kill("edge-a")
        h.kill(gone)
        kept_files = sorted((tmp_path / "edge-a" / "edge-journal").iterdir())
        modes = {stat.S_IMODE(p.stat().st_mode) for p in kept_files}
        assert h.status()["version"] == 0  # type: ignore[index]  # the round is still open at the root
        h.edge("edge-a")  # the same config, port and out_dir
        assert h.wait("root", 120) == 0, h.dump()
        assert h.wait(kept, 30) == 0, h.dump()
        records = h.records()
        partials = h.edge_records("edge-a")
        events = h.events()
        log = (tmp_path / "edge-a.log").read_text()

    taken = sorted(e["node"] for e in events if e["outcome"] == "accepted")
    assert len(taken) == 3 and silent not in taken, events
    assert "took back 3 updates" in log, log
    assert [(r["version"], r["num_results"], r["hier_nodes_via_edges"]) for r in records] == [(1, 3, 3)], records
    (sent,) = partials  # the killed edge sent nothing; the restarted one sent the three
    assert sent["answer"] == "accepted" and sent["nodes"] == taken, sent
    assert len(kept_files) == 3 and modes == {0o600}, (kept_files, modes)  # the nodes' updates: the edge's user only
    assert not (tmp_path / "edge-a" / "edge-journal").exists()  # nothing is left after the run


def test_the_journal_is_private_and_goes_when_its_round_is_answered_or_the_root_moved_on(tmp_path) -> None:
    """Fast, without processes: each kept update is 0600 in a 0700 folder; a round's files go once the
    root answered its partial; at start-up, kept files of a round the root no longer serves go at the
    root's first answer; at the end of the run the folder goes too."""
    from shoal.server.edge.app import _edge_app
    from shoal.server.edge.journal import JOURNAL, RoundJournal
    from shoal.server.edge.service import EdgeNodes, edge_spec
    from shoal.server.edge.uplink import Uplink
    from shoal.server.registry import Registry

    from ..server.live import small_config

    cfg = small_config(tmp_path, {"hierarchy": {"parent": "http://127.0.0.1:1"}})
    folder = tmp_path / "edge-journal"
    journal = RoundJournal(folder)
    journal.keep(3, 2, "n0", b"update of n0")
    journal.keep(3, 2, "n1", b"update of n1")
    journal.keep(4, 3, "n0", b"a later round's")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o600}
    journal.drop_round(4)  # the root answered round 4's partial
    assert journal.nodes() == ["n0", "n1"] and journal.entries(3, 2) == [
        ("n0", b"update of n0"),
        ("n1", b"update of n1"),
    ]

    # an edge restarted with those files: the root's first answers show it moved on to round 5
    edge = EdgeNodes(cfg, edge_spec(cfg))
    registry = Registry(cfg.server.db)
    app = _edge_app(edge, registry)
    app[JOURNAL] = RoundJournal(folder)
    up = Uplink(edge, app, None, "http://127.0.0.1:1", None)  # type: ignore[arg-type]  # no request is made
    edge.from_root({"edge": "edge-a", "status": "wait", "version": 4}, 0.0)
    up.prune_journal()
    assert list(folder.iterdir()) == []
    app[JOURNAL].keep(5, 4, "n0", b"x")
    edge.from_root({"edge": "edge-a", "status": "work", "round": 5, "version": 4, "tasks": {"n0": 1}}, 0.1)
    up.prune_journal()  # the round served here: kept
    assert [p.name for p in folder.iterdir()] == [RoundJournal._name(5, 4, "n0")]
    edge.from_root({"edge": "edge-a", "status": "done", "version": 5}, 0.2)
    up.prune_journal()
    assert not folder.exists()
    registry.close()
