"""A federation that stays up (docs/deploy.md): many runs on one server (runs.py), their
database (runs_db.py), researchers and what a run releases to them (researchers.py, release.py),
each run's health (run_health.py), signed task bundles (bundle_store.py, bundle_routes.py), the HTTP
routes (routes.py) and `shoal run` (run_cli.py)."""
