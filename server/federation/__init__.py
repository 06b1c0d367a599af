"""A federation that stays up (docs/federation.md): many runs on one server (runs.py), their
database (runs_db.py), researchers and what a run releases to them (researchers.py, release.py),
each run's health (run_health.py), the HTTP routes (routes.py) and `shoal run` (run_cli.py)."""
