"""The aggregator's state machine: round objects + validation + checkpoints + metrics.

No sockets and no clocks here (time is passed in as ``now``, monotonic seconds): the
HTTP layer (app.py) turns requests into calls of :meth:`poll`, :meth:`submit` and
:meth:`tick`, and answers what they return. Round logic itself lives in the objects
the simulator drives: shoal.rounds.SyncRounds (``server.mode = "sync"``: selection,
deadline, minimum fraction, late results) and shoal.async_rounds.AsyncRounds
(``"async"``: FedAsync / FedBuff as ``[asynchronous]`` says).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shoal import synthetic
from shoal.aggregation import make_strategy
from shoal.aggregation.robust import make_aggregator
from shoal.aggregation.secagg_encoding import FixedPoint
from shoal.aggregation.staleness import make_staleness_weight
from shoal.async_rounds import AsyncRounds
from shoal.client.training import LocalTrainer
from shoal.config import Config, DataConfig
from shoal.datasets import FEMNIST_CLASSES, IMAGE_SHAPE, load_federated
from shoal.errors import ConfigError, UpdateRejected
from shoal.metrics import _clean
from shoal.models import build_model
from shoal.rounds import SyncRounds
from shoal.assembly import make_async_rounds
from shoal.wire import MAX_HEADER_BYTES, decode_update, encode_model

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .secure_round import SecureRound

log = logging.getLogger(__name__)


def model_io(data: DataConfig) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of a dataset, without loading it."""
    if data.dataset == "synthetic":
        return (synthetic.DIMENSION,), synthetic.NUM_CLASSES
    return IMAGE_SHAPE, FEMNIST_CLASSES if data.dataset == "femnist" else 10


@dataclass
class Counters:
    """Totals since the process started (Prometheus counters)."""

    accepted: int = 0
    bytes_received: int = 0
    rounds_completed: int = 0
    rounds_abandoned: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class ServerService:
    """One aggregator: its model, rounds, nodes seen, checkpoints and metrics."""

    def __init__(self, cfg: Config, resume: bool = True):
        if cfg.privacy.mode != "none":  # refuse rather than train without the privacy the user asked for
            raise ConfigError(
                f"privacy.mode = {cfg.privacy.mode!r}: shoal server does not apply differential privacy yet "
                "(it runs in `shoal simulate` and `shoal privacy-sweep`); set privacy.mode = 'none'"
            )
        self.cfg = cfg
        s = cfg.server
        seed = cfg.simulation.seed
        self.test: tuple[torch.Tensor, torch.Tensor] | None = None
        if s.eval:
            data = load_federated(cfg.data, cfg.simulation.num_clients, seed)
            self.test = (data.test.x, data.test.y)
            shape, classes = data.input_shape, data.num_classes
        else:
            shape, classes = model_io(cfg.data)
        torch.manual_seed(seed)  # the same initial model as `shoal simulate` with this seed
        self.trainer = LocalTrainer(build_model(cfg.model.name, shape, classes), cfg.train, "cpu")
        self.spec = self.trainer.spec
        self.max_body_bytes = s.max_body_bytes or self.spec.nbytes + MAX_HEADER_BYTES
        self.mode = s.mode
        self.rounds: SyncRounds | AsyncRounds
        flat = self.trainer.flat.detach().clone()
        if s.mode == "sync":
            a = cfg.asynchronous
            self.rounds = SyncRounds(
                make_strategy(cfg.strategy, self.spec.numel, aggregator=make_aggregator(cfg.robust, self.spec.numel)),
                flat, s.clients_per_round, s.fraction, seed,
                over_selection=a.over_selection, deadline_s=s.deadline_s, min_fraction=s.min_fraction,
                late=a.late, late_weight=make_staleness_weight(a.staleness_weight, a.staleness_a, a.staleness_b),
                max_staleness=a.max_staleness,
            )
        else:
            self.rounds = make_async_rounds(cfg, flat, self.spec.numel)
        self.ckpt_dir = Path(s.checkpoint_dir)
        self.out_dir = Path(s.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.counters = Counters()
        self.last_seen: dict[str, float] = {}
        self.told_done: set[str] = set()
        self.done_at: float | None = None
        self.last_record: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self._model_cache: tuple[int, bytes] | None = None
        self.secure_round: SecureRound | None = None  # [secure_aggregation]: the open round's protocol
        if cfg.secure_aggregation.enabled and s.clients_per_round:  # the headroom check, before any round
            FixedPoint(cfg.secure_aggregation.clip, cfg.secure_aggregation.bits,
                       math.ceil(s.clients_per_round * (1 + cfg.asynchronous.over_selection)))
        self.secure_last: dict[str, Any] = {}
        self._t0 = time.perf_counter()
        if resume and (path := latest_checkpoint(self.ckpt_dir)) is not None:
            self._restore(path)
        elif not resume or not self.metrics_path.exists():
            self.metrics_path.write_text("")

    # --- state ---------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.rounds.version

    @property
    def done(self) -> bool:
        return self.rounds.version >= self.cfg.server.rounds

    def finished(self, now: float) -> bool:
        """Done, and every connected node was told so (or one poll period passed)."""
        if not self.done:
            return False
        self.done_at = self.done_at if self.done_at is not None else now
        waiting = set(self.connected(now)) - self.told_done
        return not waiting or now - self.done_at > self.cfg.server.poll_s + 5

    def connected(self, now: float) -> list[str]:
        """Nodes heard from within one long-poll period (plus 5 s of slack)."""
        horizon = self.cfg.server.poll_s + 5.0
        return sorted(n for n, t in self.last_seen.items() if now - t <= horizon)

    def seen(self, node: str, now: float) -> None:
        self.last_seen[node] = now

    def model_body(self) -> bytes:
        """The current global model on the wire, encoded once per version."""
        if self._model_cache is None or self._model_cache[0] != self.version:
            self._model_cache = (self.version, encode_model(self.rounds.global_params, self.spec, self.version))
        return self._model_cache[1]

    @property
    def etag(self) -> str:
        return f'"{self.spec.hash}-v{self.version}"'

    # --- requests ------------------------------------------------------------------

    def poll(self, node: str, now: float) -> dict[str, Any] | None:
        """The node's work if it has any now; ``{"status": "done"}`` at the end; else None."""
        self.seen(node, now)
        if self.done:
            self.told_done.add(node)
            return {"status": "done", "version": self.version}
        r = self.rounds
        if isinstance(r, AsyncRounds):
            if len(self.connected(now)) < self.cfg.server.min_nodes:
                return None
            t = r.task(node)
            return {"status": "work", "round": t.round, "version": t.version, "seed": t.seed}
        if r.open and node in r.selected and node not in r.received:
            if self.secure_round is not None and not self.secure_round.wants_task(node):
                return None
            t = r.selected[node]
            left = (r.deadline_at or now) - now
            work = {"status": "work", "round": t.round, "version": t.version, "seed": t.seed,
                    "deadline_s": round(max(left, 0.0), 3)}
            if self.secure_round is not None:
                work["secure_aggregation"] = self.secure_round.task_info()
            return work
        return None

    def secure(self, node: str, now: float) -> SecureRound:
        """The open round's secure aggregation, for the /v1/secagg routes."""
        self.seen(node, now)
        if self.secure_round is None:
            what = "secure aggregation is off" if not self.cfg.secure_aggregation.enabled else "no round is open"
            raise UpdateRejected("round_closed", f"{what} (version {self.version})")
        return self.secure_round

    def submit(self, node: str, body: bytes | memoryview, now: float) -> dict[str, Any]:
        """Validate one upload and stream it into the open round; raises a ShoalError
        (WireError or UpdateRejected) with nothing changed if it is refused. A writable
        ``body`` is decoded in place (no copy); it may be reused once this returns."""
        self.seen(node, now)
        try:
            s = self.cfg.server
            update, header = decode_update(body, self.spec, self.max_body_bytes, copy=False,
                                           max_examples=s.max_examples, max_abs=s.max_delta_abs)
            r = self.rounds
            if self.cfg.secure_aggregation.enabled:
                raise UpdateRejected("secure_round", "rounds are securely aggregated: send masked input through "
                                     "/v1/secagg (docs/protocol.md), not a plain update")
            if self.done:
                raise UpdateRejected("done", f"training is complete at version {r.version}; no more updates")
            if update.base_version > r.version:
                raise UpdateRejected("unknown_version",
                                     f"base version {update.base_version} is newer than the server's {r.version}")
            if (isinstance(r, SyncRounds) and r.open and node not in r.late_pending
                    and "round" in header and header["round"] != r.round):
                raise UpdateRejected("wrong_round", f"update is for round {header['round']!r}, the open round is {r.round}")
            update.sender = node  # the authenticated identity, not what the body claims
            advanced = r.submit(node, update)
        except Exception as e:
            self.refused(getattr(e, "code", "error"))
            raise
        self.counters.accepted += 1
        self.counters.bytes_received += len(body)
        if advanced:  # async: the update completed a new version
            self._new_version({"updates_accepted": self.rounds.stats.accepted})
        return {"status": "accepted", "round": self._round, "version": self.version}

    def refused(self, code: str) -> None:
        """Count an upload refused with error ``code`` (here or by the transport)."""
        self.counters.rejected[code] = self.counters.rejected.get(code, 0) + 1

    # --- the clock -----------------------------------------------------------------

    @property
    def _round(self) -> int:
        return self.rounds.round if isinstance(self.rounds, SyncRounds) else self.rounds.version

    def tick(self, now: float) -> bool:
        """Open or close a sync round if it is time; True when something changed."""
        r = self.rounds
        if self.done or not isinstance(r, SyncRounds):
            return False
        if not r.open:
            avail = self.connected(now)
            if len(avail) < self.cfg.server.min_nodes:
                return False
            tasks = r.start_round(avail, now)
            log.info("round %d: %d of %d nodes selected, version %d", r.round, len(tasks), len(avail), r.version)
            if self.cfg.secure_aggregation.enabled:
                self.secure_round = SecureRound(self.cfg, r, self.spec.numel + 1, now)
            return True
        if self.secure_round is not None:  # the protocol's stages decide when the round closes
            changed = self.secure_round.tick(now)
            if not self.secure_round.over:
                return changed
            secure, self.secure_round = self.secure_round, None
            self.secure_last = secure.status()
            summary = secure.close(r)
            if summary is None:  # aborted: model and version unchanged, the next round runs
                self.counters.rounds_abandoned += 1
                return True
        elif not r.should_close(now):
            return False
        else:
            summary = r.finish_round()
        if summary.failed:
            self.counters.rounds_abandoned += 1
            log.warning("round %d failed at its deadline with %d of %d results (min_fraction %.2f); model unchanged",
                        r.round, summary.num_results, summary.num_selected, self.cfg.server.min_fraction)
            return True
        if summary.num_results < summary.num_selected:
            log.info("round %d: deadline, closed with %d of %d results", r.round, summary.num_results,
                     summary.num_selected)
        self._new_version({"round": summary.round, "train_loss": summary.train_loss,
                           "num_results": summary.num_results, "num_examples": summary.num_examples,
                           "num_late": summary.num_late})
        return True

    def _new_version(self, fields: dict[str, Any]) -> None:
        """A new global version: evaluate, checkpoint, then log (the simulator's record shape)."""
        self.counters.rounds_completed += 1
        record: dict[str, Any] = {"round": self._round, "version": self.version}
        if self.test is not None:
            ev = self.trainer.evaluate(self.rounds.global_params, *self.test)
            record.update(test_accuracy=ev["accuracy"], test_loss=ev["loss"])
        record.update(fields)
        record["elapsed_s"] = round(time.perf_counter() - self._t0, 4)
        self.last_record = _clean(record)
        self._checkpoint()  # first: a crash between the two loses a log line, never a version
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(self.last_record) + "\n")
        log.info("version %d: %s", self.version, json.dumps(self.last_record))

    # --- checkpoints ---------------------------------------------------------------

    def _checkpoint(self) -> Path:
        tensors: dict[str, torch.Tensor] = {}
        state = {"mode": self.mode, "version": self.version, "round": self._round,
                 "spec_hash": self.spec.hash, "last_record": self.last_record,
                 "rounds": _split_tensors(self.rounds.state_dict(), "rounds", tensors)}
        return save_checkpoint(self.ckpt_dir, self.version, tensors, state, self.cfg.server.keep_checkpoints)

    def _restore(self, path: Path) -> None:
        tensors, state = load_checkpoint(path)
        if state.get("spec_hash") != self.spec.hash or state.get("mode") != self.mode:
            raise ConfigError(
                f"checkpoint {path} is of a {state.get('mode')!r} server with model spec {state.get('spec_hash')!r}; "
                f"this config is {self.mode!r} with {self.spec.hash!r}: use the config it was made with, "
                "or another server.checkpoint_dir"
            )
        self.rounds.load_state_dict(_join_tensors(state["rounds"], tensors))
        self.last_record = state.get("last_record", {})
        self.resumed_from = path
        log.info("resumed from %s: version %d, round %d", path, self.version, self._round)

    # --- observability -------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        r = self.rounds
        return {
            "mode": self.mode, "round": self._round, "version": r.version,
            "rounds_target": self.cfg.server.rounds, "done": self.done,
            "round_open": bool(getattr(r, "open", False)),
            "selected": sorted(r.selected) if getattr(r, "open", False) else [],
            "received": len(r.received) if getattr(r, "open", False) else 0,
            "outstanding": len(r.outstanding) if isinstance(r, AsyncRounds) else 0,
            "connected_nodes": self.connected(now), "last_metrics": self.last_record,
            "spec_hash": self.spec.hash, "num_parameters": self.spec.numel,
            "updates_accepted": self.counters.accepted, "updates_rejected": dict(self.counters.rejected),
            **({"secure_aggregation": self.secure_round.status() if self.secure_round else self.secure_last}
               if self.cfg.secure_aggregation.enabled else {}),
        }

    def prometheus(self, now: float) -> str:
        c = self.counters
        lines = [
            "# HELP shoal_version Current global model version.", "# TYPE shoal_version gauge",
            f"shoal_version {self.version}",
            "# HELP shoal_round Current round number.", "# TYPE shoal_round gauge",
            f"shoal_round {self._round}",
            "# HELP shoal_connected_nodes Nodes heard from within one poll period.",
            "# TYPE shoal_connected_nodes gauge", f"shoal_connected_nodes {len(self.connected(now))}",
            "# HELP shoal_updates_accepted_total Updates accepted.", "# TYPE shoal_updates_accepted_total counter",
            f"shoal_updates_accepted_total {c.accepted}",
            "# HELP shoal_updates_rejected_total Updates refused, by error code.",
            "# TYPE shoal_updates_rejected_total counter",
            *[f'shoal_updates_rejected_total{{code="{k}"}} {v}' for k, v in sorted(c.rejected.items())],
            "# HELP shoal_update_bytes_total Bytes of accepted updates.", "# TYPE shoal_update_bytes_total counter",
            f"shoal_update_bytes_total {c.bytes_received}",
            "# HELP shoal_rounds_completed_total Rounds closed into a new version.",
            "# TYPE shoal_rounds_completed_total counter", f"shoal_rounds_completed_total {c.rounds_completed}",
            "# HELP shoal_rounds_dropped_total Rounds dropped at the deadline with too few results.",
            "# TYPE shoal_rounds_dropped_total counter", f"shoal_rounds_dropped_total {c.rounds_abandoned}",
        ]
        for key in ("test_accuracy", "test_loss", "train_loss"):
            v = self.last_record.get(key)
            if isinstance(v, (int, float)):
                lines += [f"# TYPE shoal_{key} gauge", f"shoal_{key} {v}"]
        return "\n".join(lines) + "\n"


def _split_tensors(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``{"__tensor__": name}``, tensors into ``tensors``
    (the global model is stored as ``params``, the name a reader looks for)."""
    if isinstance(obj, torch.Tensor):
        name = "params" if path == "rounds.global_params" else path
        tensors[name] = obj
        return {"__tensor__": name}
    if isinstance(obj, dict):
        return {str(k): _split_tensors(v, f"{path}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split_tensors(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj
