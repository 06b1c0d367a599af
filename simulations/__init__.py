"""Many clients and peers in one process: the in-process engine, experiments, reports."""
