"""A node's small reports, parsed without I/O: its federated evaluation of a global version
(POST /v1/eval) and its notice that its task failed (POST /v1/failed); and the refusal a node with
another model's spec gets."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from shoal.errors import Malformed, NonFinite, UpdateRejected
from shoal.strict_json import NonFiniteNumber, loads_strict

#: Bounds of a node's federated evaluation report (POST /v1/eval, docs/protocol.md).
MAX_EVAL_BODY = 64 * 1024
MAX_EVAL_METRICS = 32
MAX_EVAL_EXAMPLES = 10**9
_METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")


@dataclass
class FedVersion:
    """The nodes' evaluations of one global version, summed as they arrive."""

    asked: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)
    sums: dict[str, float] = field(default_factory=dict)  # metric -> sum of value x examples
    counts: dict[str, int] = field(default_factory=dict)  # metric -> examples behind it
    num_examples: int = 0


def parse_eval_report(body: bytes) -> tuple[int, int, dict[str, float]]:
    """``(version, num_examples, metrics)`` of a JSON report; Malformed/NonFinite if it is not one."""
    try:
        obj = loads_strict(body)
    except NonFiniteNumber as e:
        raise NonFinite(f"evaluation report: {e}") from None
    except ValueError as e:
        raise Malformed(f"evaluation report is not JSON: {e}"[:200]) from None
    if not isinstance(obj, dict):
        raise Malformed("evaluation report must be a JSON object {version, num_examples, metrics}")
    unknown = sorted(str(k)[:40] for k in set(obj) - {"version", "num_examples", "metrics"})
    if unknown:
        raise Malformed(f"evaluation report has unknown fields {unknown[:5]}; expected version, num_examples, metrics")
    ints = {}
    for key, low, high in (("version", 0, 2**53), ("num_examples", 1, MAX_EVAL_EXAMPLES)):
        v = obj.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise Malformed(f"evaluation report field {key!r} must be an integer in [{low}, {high}], got {str(v)[:40]}")
        ints[key] = v
    metrics = obj.get("metrics")
    if not isinstance(metrics, dict) or not 1 <= len(metrics) <= MAX_EVAL_METRICS:
        raise Malformed(f"evaluation report field 'metrics' must map 1 to {MAX_EVAL_METRICS} names to numbers")
    out: dict[str, float] = {}
    for name, v in metrics.items():
        if not _METRIC_NAME.fullmatch(name) or name == "num_examples":
            raise Malformed(
                f"metric name {name[:70]!r} must match [A-Za-z][A-Za-z0-9_.-]{{0,63}} and not be 'num_examples'"
            )
        try:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise ValueError
        except (OverflowError, ValueError):
            raise NonFinite(f"metric {name!r} must be a finite number, got {str(v)[:40]}") from None
        out[name] = float(v)
    return ints["version"], ints["num_examples"], out


#: A node's report that its task failed on the node (POST /v1/failed, docs/protocol.md).
MAX_FAILURE_BODY = 1024
#: ``diverged``: a non-finite loss or update; ``refused``: the node's operator policy refuses the
#: run's config that came with the task (a federation's node, client/daemon.py); ``failed``: the
#: task's own code raised on the node (its model, loss, data or metrics; the node stops taking part),
#: or, with no reason, a local- or distributed-DP node's notice, judged from its noised update only.
FAILURE_REASONS = ("diverged", "refused", "failed")


def parse_failure_report(body: bytes) -> tuple[int, int, str]:
    """``(round, version, reason)`` of a JSON failure report; Malformed if it is not one."""
    try:
        obj = loads_strict(body)
    except ValueError as e:
        raise Malformed(f"failure report is not JSON: {e}"[:200]) from None
    if not isinstance(obj, dict) or set(obj) != {"round", "version", "reason"}:
        raise Malformed(
            'a failure report is a JSON object {"round": r, "version": v, "reason": "diverged", "refused" or "failed"}'
        )
    for key in ("round", "version"):
        v = obj[key]
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 2**53:
            raise Malformed(f"failure report field {key!r} must be an integer >= 0, got {str(v)[:40]}")
    if obj["reason"] not in FAILURE_REASONS:
        raise Malformed(f"failure report reason {str(obj['reason'])[:40]!r} is not one of {list(FAILURE_REASONS)}")
    return obj["round"], obj["version"], obj["reason"]


def not_held_report(node: str, round_: int, version: int, at_round: int, at_version: int) -> UpdateRejected:
    """The refusal of a failure report for a task the node does not hold (or reported already)."""
    return UpdateRejected(
        "not_selected",
        f"node {node!r} holds no task of round {round_} from version {version} (the server is at round "
        f"{at_round}, version {at_version}); report only the task the node holds, once",
    )


def spec_mismatch_detail(node_hash: str, server_hash: str) -> str:
    return (
        f"model spec mismatch: the node's model has spec hash {node_hash!r}, the server's has {server_hash!r} "
        "(another architecture, parameter layout or frozen base weights): run the node with the same task, model "
        "and base checkpoint as the server "
        "(--task / [task] app and [task.args]; for the built-in task the same [model] and [data])"
    )
