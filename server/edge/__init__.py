"""The edge tier (`shoal server --parent`, docs/hierarchy.md): the root's intake of edge partials
(intake.py) and the edge's own rounds (rounds.py) without I/O; the edge's state (service.py), its
journal, its uplink to the root, its secure-aggregation relay (secure.py) and its app (app.py)."""
