"""Federated evaluation on the server, without I/O: which versions the nodes evaluate, their
reports summed as they arrive, and each version's record once no node can still report.

The nodes evaluate the global model on their own test data (a task the server holds no test data
for still gets curves); the server pools their example-weighted means. A version is written when
every node asked has reported or can no longer (it holds no task from that version), and at the
end of the run. Under a privacy mode whose plan forbids un-noised client figures
(``PrivacyPlan.client_evaluations``) no node is asked.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from shoal.client.training import summarize_means
from shoal.errors import Malformed, UpdateRejected
from shoal.metrics import json_safe
from shoal.rounds import evaluation_due
from shoal.task import Task, TaskError

from .node_reports import MAX_EVAL_METRICS, FedVersion, parse_eval_report

log = logging.getLogger(__name__)

#: whether node ``n`` still holds a task from version ``v`` (so it may still report ``v``)
HoldsTask = Callable[[str, int], bool]


class FederatedEvaluation:
    """The open versions' evaluations (``open``), the last one written (``last``)."""

    def __init__(self, task: Task, every: int, last_round: int, allowed: bool):
        """``every``: ``simulation.eval_every``; ``last_round``: ``server.rounds`` (0: no end);
        ``allowed``: the privacy plan lets the nodes report un-noised figures of their data."""
        self.task, self.every, self.last_round, self.allowed = task, every, last_round, allowed
        self.open: dict[int, FedVersion] = {}
        self.finished = False  # the final version's evaluation is written
        self.last: dict[str, Any] = {}

    def wants(self, version: int) -> bool:
        """Versions the nodes evaluate: every ``simulation.eval_every``-th, and the last."""
        return not self.finished and self.allowed and evaluation_due(version, self.every, self.last_round)

    def ask(self, answer: dict[str, Any], node: str, evaluates: bool) -> dict[str, Any]:
        """A poll's answer, with ``"evaluate": true`` when ``node`` (which has test data) should
        evaluate the version it is handed."""
        v = int(answer["version"])
        if evaluates and self.wants(v):
            fed = self.open.setdefault(v, FedVersion())
            if node not in fed.reported:
                fed.asked.add(node)
                answer["evaluate"] = True
        return answer

    def take(self, node: str, body: bytes, current: int) -> int:
        """Add one node's report (POST /v1/eval) at server version ``current``; its version. A
        ShoalError with nothing changed if the report is refused."""
        version, n, metrics = parse_eval_report(body)
        fed = self.open.get(version)
        if version > current:
            raise UpdateRejected("unknown_version", f"version {version} is newer than the server's {current}")
        if fed is None or node not in fed.asked:
            what = "closed" if fed is None else "not asked of this node"
            raise UpdateRejected(
                "eval_not_open",
                f"evaluation of version {version} is {what} (the server is at version {current}); report only "
                "versions a task said to evaluate",
            )
        if node in fed.reported:
            raise UpdateRejected("duplicate", f"this node already reported its evaluation of version {version}")
        names = set(fed.counts) | set(metrics)
        if len(names) > MAX_EVAL_METRICS:
            raise Malformed(f"version {version} would have {len(names)} metric names, over {MAX_EVAL_METRICS}")
        fed.reported.add(node)
        fed.num_examples += n
        for name, v in metrics.items():
            fed.sums[name] = fed.sums.get(name, 0.0) + v * n
            fed.counts[name] = fed.counts.get(name, 0) + n
        return version

    def waiting_on(self, version: int) -> set[str]:
        """Nodes asked to evaluate ``version`` that have not reported yet."""
        fed = self.open.get(version)
        return fed.asked - fed.reported if fed is not None else set()

    def settle(self, current: int, holds_task: HoldsTask, elapsed_s: float) -> list[dict[str, Any]]:
        """The records of older versions that no node can still report (a node may while it
        holds a task from that version; async: until the task is too stale to be taken)."""

        def over(v: int) -> bool:
            return v < current and not any(holds_task(n, v) for n in self.waiting_on(v))

        return self.close(over, elapsed_s)

    def finish(self, elapsed_s: float) -> list[dict[str, Any]]:
        """The run is over: every open version's record; no version is evaluated after this."""
        records = self.close(lambda v: True, elapsed_s)
        self.finished = True
        return records

    def close(self, which: Callable[[int], bool], elapsed_s: float) -> list[dict[str, Any]]:
        """The record of every open version ``which(v)`` selects that any node reported (closed)."""
        records = []
        for v in sorted(k for k in self.open if which(k)):
            fed = self.open.pop(v)
            if not fed.reported:
                continue
            record: dict[str, Any] = {"version": v, "evaluation": "federated"}
            means = {k: fed.sums[k] / fed.counts[k] for k in sorted(fed.sums)}
            # the global model's figures, and the personalised ones (personal_*: algorithm.personal_eval_steps)
            personal = {k.removeprefix("personal_"): m for k, m in means.items() if k.startswith("personal_")}
            own = {k: m for k, m in means.items() if not k.startswith("personal_")}
            for prefix, part in (("", own), ("personal_", personal)):
                try:  # derived figures (perplexity, R²) from the pooled means, once
                    part = summarize_means(self.task, part) if part else part
                except TaskError as e:
                    log.warning("federated evaluation of version %d: %s; writing the raw means", v, e)
                record.update({f"fed_{prefix}{k}": part[k] for k in part})
            record.update(fed_num_examples=fed.num_examples, fed_nodes=len(fed.reported), elapsed_s=elapsed_s)
            self.last = json_safe(record)
            log.info("version %d, federated evaluation: %s", v, json.dumps(self.last))
            records.append(self.last)
        return records
