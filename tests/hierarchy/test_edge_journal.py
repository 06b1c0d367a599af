"""An edge process SIGKILLed in the middle of a round and started again keeps the updates it had
taken: they are on disk (the edge's journal) before a node hears "accepted", and the restarted edge
takes them back into its sum, so the root counts them. Real processes on 127.0.0.1: a root, one
edge and four nodes in two node hosts; one node never uploads (the edge waits for it, which leaves
the time to kill), and its host goes down with the edge (so the restarted edge does not wait for it
again). Bounded: every wait has a timeout and every process is killed at the end."""

from __future__ import annotations

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
    assert not list((tmp_path / "edge-a" / "edge-journal").glob("*.tmp"))
