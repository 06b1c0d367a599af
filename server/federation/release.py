"""What a researcher sees of their own run: the run's privacy release policy, in one place.

A run without DP (``privacy.mode = "none"``) shows its researcher everything the admin sees of
it. Under DP the researcher's view carries only what the run's accountant covers: the released
model's figures, the privacy figures themselves and the noised counts of ``privacy.release =
"noised"`` (shoal/privacy_plan.py ``release_served_record``: no wall-clock timing), and never which
nodes a round selected, how many reported, or any node's own figures; a run whose config says ``release = "clear"`` is
shown to its researcher as ``withhold`` (clear figures are the operator's, outside the claim).
Every route that renders a run for a researcher (``GET /v1/runs/{run}``, its metrics, `shoal run
pull`) calls this module; the admin's views do not. The dashboard is the admin's only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from shoal.config import Config
from shoal.privacy_plan import PrivacyPlan, plan_of

#: What of a run's summary (``Federation._summary``) a researcher always sees.
RUN_FIELDS = ("run", "task", "status", "submitted_by", "reason", "version", "round", "rounds_target", "config")
#: What of the service's status a researcher of a DP run sees (no selection, counts, nodes).
SERVICE_FIELDS = ("mode", "round", "version", "rounds_target", "done", "stopped", "spec_hash", "num_parameters")
#: The privacy status fields that are the accountant's own claims (not per-node, not counts).
PRIVACY_FIELDS = (
    "epsilon",
    "epsilon_next",
    "delta",
    "privacy_mode",
    "accountant",
    "sampling",
    "sampling_rate",
    "rounds_charged",
    "clip_norm",
    "target_epsilon",
    "epsilon_node",
    "epsilon_server",
    "server_accountant",
    "stopped",
)


def withholds(cfg: Config | None) -> bool:
    """A researcher's view of this run is filtered (DP, or a config that no longer builds)."""
    return cfg is None or plan_of(cfg).enabled


def _plan(cfg: Config | None) -> PrivacyPlan | None:
    if cfg is None:
        return None
    plan = plan_of(cfg)
    return dataclasses.replace(plan, release="withhold") if plan.release == "clear" else plan


def researcher_line(line: dict[str, Any], cfg: Config | None) -> dict[str, Any]:
    """One metrics line as the run's researcher sees it."""
    if not withholds(cfg):
        return line
    plan = _plan(cfg)
    if plan is None or not plan.enabled:  # a config we cannot read: only where the run is
        return {k: line[k] for k in ("round", "version") if k in line}
    return plan.release_served_record(line)


def researcher_view(status: dict[str, Any], cfg: Config | None) -> dict[str, Any]:
    """``GET /v1/runs/{run}`` as the run's researcher sees it."""
    if not withholds(cfg):
        return status
    out = {k: status[k] for k in RUN_FIELDS if k in status}
    reasons = sorted({a.get("reason", "") for a in status.get("nodes", {}).values() if a.get("reason")})
    if reasons:  # the operators' policy reasons, without which node or how many
        out["refusals"] = reasons
    svc = status.get("service")
    if isinstance(svc, dict):
        view = {k: svc[k] for k in SERVICE_FIELDS if k in svc}
        if isinstance(svc.get("last_metrics"), dict):
            view["last_metrics"] = researcher_line(svc["last_metrics"], cfg)
        if isinstance(svc.get("privacy"), dict):
            view["privacy"] = {k: svc["privacy"][k] for k in PRIVACY_FIELDS if k in svc["privacy"]}
        out["service"] = view
    out["view"] = "researcher: only what the run's privacy accountant covers (server/federation/release.py)"
    return out


def released_file(name: str, data: bytes, cfg: Config | None) -> bytes:
    """``metrics.jsonl`` or ``summary.json`` of a DP run as its researcher may pull it."""
    if name == "metrics.jsonl":
        lines = [json.loads(x) for x in data.decode().splitlines() if x.strip()]
        return b"".join(json.dumps(researcher_line(x, cfg)).encode() + b"\n" for x in lines)
    summary = json.loads(data)
    out = {k: v for k, v in summary.items() if k in ("run", "status", "reason", "version", "rounds")}
    for key in ("last_metrics", "last_federated"):  # no counts of accepted or refused updates
        if isinstance(summary.get(key), dict):
            out[key] = researcher_line(summary[key], cfg)
    return (json.dumps(out, indent=2) + "\n").encode()
