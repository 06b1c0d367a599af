"""Real processes on 127.0.0.1 under an async (FedBuff) root: a root, two edge processes and eight
nodes in one node host (the real node code, tests/hierarchy/nodehost.py). Each edge buffers its
nodes' updates by version and sends partials up; the root counts a partial of k nodes as k updates.
Counts are exact: the root's accepted updates are the nodes inside the partials it took, and every
update an edge took from a node went into exactly one partial. Bounded: every wait has a timeout and
every process is killed at the end."""

from __future__ import annotations

from collections import Counter

import pytest

from .deploy import hierarchy

VERSIONS = 20
ADD = {"server": 'mode = "async"', "hierarchy": "edge_buffer = 2\nedge_flush_s = 0.5"}
TABLES = '[asynchronous]\nalgorithm = "fedbuff"\nbuffer_size = 6\nmax_staleness = 4\nstaleness_weight = "polynomial"\n'


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_async_root_counts_edge_partials_exactly(tmp_path):
    with hierarchy(tmp_path, n=8, edges=2, rounds=VERSIONS, deadline=10.0, extra=TABLES, add=ADD) as h:
        h.start_servers()
        (host,) = h.hosts(1)
        assert h.wait("root", 150) == 0, h.dump()
        assert h.wait(host, 30) == 0, h.dump()
        for e in h.edge_names:
            assert h.wait(e, 30) == 0, h.dump()
        records = h.records()
        partials = {e: h.edge_records(e) for e in h.edge_names}
        events = h.events()

    assert [r["version"] for r in records] == list(range(1, VERSIONS + 1)), records
    sent = partials["edge-a"] + partials["edge-b"]
    taken = [p for p in sent if p["answer"] == "accepted"]
    assert all(any(p["answer"] == "accepted" for p in partials[e]) for e in h.edge_names), sent
    # the root counted exactly the nodes inside the partials it took, a partial of k nodes as k updates
    assert records[-1]["updates_accepted"] == sum(p["nodes_in"] for p in taken), (records[-1], taken)
    assert sum(r.get("hier_nodes_via_edges", 0) for r in records) == sum(p["nodes_in"] for p in taken)
    assert any(p["nodes_in"] > 1 for p in taken), taken
    # nothing refused but what came after the run ended
    assert all(p["answer"] == "accepted" or p.get("refusal") == "done" for p in sent), sent
    # every update an edge took from a node went into one partial (the last, at most, never went up:
    # the root was done); none twice
    took = Counter(e["node"] for e in events if e["outcome"] == "accepted")
    inside = Counter(n for p in sent for n in p["nodes"])
    assert all(0 <= took[n] - inside[n] <= 1 for n in took | inside), (took, inside)
