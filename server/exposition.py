"""The aggregator's figures in Prometheus' text exposition format (GET /metrics)."""

from __future__ import annotations

import re

from .service import ServerService

_PROM_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def prometheus_text(svc: ServerService, now: float) -> str:
    """Counters since the process started, the version and round, and the last record's
    central (``test_*``, ``train_loss``) and federated (``fed_*``) figures as gauges."""
    c = svc.counters
    lines = [
        "# HELP shoal_version Current global model version.",
        "# TYPE shoal_version gauge",
        f"shoal_version {svc.version}",
        "# HELP shoal_round Current round number.",
        "# TYPE shoal_round gauge",
        f"shoal_round {svc.rounds.round}",
        "# HELP shoal_connected_nodes Nodes heard from within one poll period.",
        "# TYPE shoal_connected_nodes gauge",
        f"shoal_connected_nodes {len(svc.connected(now))}",
        "# HELP shoal_updates_accepted_total Updates accepted.",
        "# TYPE shoal_updates_accepted_total counter",
        f"shoal_updates_accepted_total {c.accepted}",
        "# HELP shoal_updates_rejected_total Updates refused, by error code.",
        "# TYPE shoal_updates_rejected_total counter",
        *[f'shoal_updates_rejected_total{{code="{k}"}} {v}' for k, v in sorted(c.rejected.items())],
        "# HELP shoal_update_bytes_total Bytes of accepted updates.",
        "# TYPE shoal_update_bytes_total counter",
        f"shoal_update_bytes_total {c.bytes_received}",
        "# HELP shoal_rounds_completed_total Rounds closed into a new version.",
        "# TYPE shoal_rounds_completed_total counter",
        f"shoal_rounds_completed_total {c.rounds_completed}",
        "# HELP shoal_rounds_dropped_total Rounds dropped at the deadline with too few results.",
        "# TYPE shoal_rounds_dropped_total counter",
        f"shoal_rounds_dropped_total {c.rounds_abandoned}",
    ]
    if svc.privacy is not None:
        lines += svc.privacy.prometheus()
    gauges = {k: v for k, v in svc.last_record.items() if k.startswith("test_") or k == "train_loss"}
    gauges.update((k, v) for k, v in svc.last_fed.items() if k.startswith("fed_"))
    for key, v in sorted(gauges.items()):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and _PROM_NAME.fullmatch(key):
            lines += [f"# TYPE shoal_{key} gauge", f"shoal_{key} {v}"]
    return "\n".join(lines) + "\n"
