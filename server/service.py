"""The aggregator's state machine: round objects + validation + checkpoints + metrics.

No sockets and no clocks here (time is passed in as ``now``, monotonic seconds): the
HTTP layer (app.py) turns requests into calls of :meth:`poll`, :meth:`submit` and
:meth:`tick`, and answers what they return. Round logic itself lives in
shoal.rounds.SyncRounds, the object the simulator drives.
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
from shoal.client.training import LocalTrainer
from shoal.config import Config, DataConfig
from shoal.datasets import FEMNIST_CLASSES, IMAGE_SHAPE, load_federated
from shoal.errors import ConfigError, UpdateRejected
from shoal.metrics import _clean
from shoal.models import build_model
from shoal.rounds import RoundSummary, SyncRounds
from shoal.wire import MAX_HEADER_BYTES, decode_update, encode_model

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

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
        strategy = make_strategy(cfg.strategy, self.spec.numel)
        self.rounds = SyncRounds(strategy, self.trainer.flat.detach().clone(), s.clients_per_round, s.fraction, seed)
        self.ckpt_dir = Path(s.checkpoint_dir)
        self.out_dir = Path(s.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.counters = Counters()
        self.last_seen: dict[str, float] = {}
        self.told_done: set[str] = set()
        self.round_started: float | None = None
        self.done_at: float | None = None
        self.last_record: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self._model_cache: tuple[int, bytes] | None = None
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
        if r.open and node in r.selected and node not in r.received:
            t = r.selected[node]
            left = self.cfg.server.deadline_s - (now - (self.round_started or now))
            return {"status": "work", "round": t.round, "version": t.version, "seed": t.seed,
                    "deadline_s": round(max(left, 0.0), 3)}
        return None

    def submit(self, node: str, body: bytes, now: float) -> dict[str, Any]:
        """Validate one upload and stream it into the open round; raises a ShoalError
        (WireError or UpdateRejected) with nothing changed if it is refused."""
        self.seen(node, now)
        try:
            update, header = decode_update(body, self.spec, self.max_body_bytes)
            r = self.rounds
            if update.base_version > r.version:
                raise UpdateRejected("unknown_version",
                                     f"base version {update.base_version} is newer than the server's {r.version}")
            if r.open and "round" in header and header["round"] != r.round:
                raise UpdateRejected("wrong_round", f"update is for round {header['round']!r}, the open round is {r.round}")
            update.sender = node  # the authenticated identity, not what the body claims
            r.submit(node, update)
        except Exception as e:
            self.refused(getattr(e, "code", "error"))
            raise
        self.counters.accepted += 1
        self.counters.bytes_received += len(body)
        return {"status": "accepted", "round": self.rounds.round, "version": self.version}

    def refused(self, code: str) -> None:
        """Count an upload refused with error ``code`` (here or by the transport)."""
        self.counters.rejected[code] = self.counters.rejected.get(code, 0) + 1

    # --- the clock -----------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """Open or close a round if it is time; True when something changed."""
        if self.done:
            return False
        s, r = self.cfg.server, self.rounds
        if not r.open:
            avail = self.connected(now)
            if len(avail) < s.min_nodes:
                return False
            tasks = r.start_round(avail)
            self.round_started = now
            log.info("round %d: %d of %d nodes selected, version %d", r.round, len(tasks), len(avail), r.version)
            return True
        if r.complete:
            self._close()
            return True
        if now - (self.round_started or now) >= s.deadline_s:
            need = max(1, math.ceil(s.min_fraction * len(r.selected)))
            if len(r.received) >= need:
                log.info("round %d: deadline, closing with %d of %d results", r.round, len(r.received), len(r.selected))
                self._close()
            else:
                # Too few results to trust: drop the round (the model is unchanged) and
                # sample afresh. SyncRounds has no abort; begin() resets the aggregator.
                log.warning("round %d: deadline with %d of %d results (need %d); round dropped",
                            r.round, len(r.received), len(r.selected), need)
                r.open = False
                self.counters.rounds_abandoned += 1
            return True
        return False

    def _close(self) -> RoundSummary:
        summary = self.rounds.finish_round()
        self.counters.rounds_completed += 1
        record: dict[str, Any] = {"round": summary.round, "version": summary.version}
        if self.test is not None:
            ev = self.trainer.evaluate(self.rounds.global_params, *self.test)
            record.update(test_accuracy=ev["accuracy"], test_loss=ev["loss"])
        record.update(train_loss=summary.train_loss, num_results=summary.num_results,
                      num_examples=summary.num_examples, elapsed_s=round(time.perf_counter() - self._t0, 4))
        self.last_record = _clean(record)
        self._checkpoint()  # first: a crash between the two loses a log line, never a version
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(self.last_record) + "\n")
        log.info("version %d: %s", summary.version, json.dumps(self.last_record))
        return summary

    # --- checkpoints ---------------------------------------------------------------

    def _checkpoint(self) -> Path:
        opt = self.rounds.strategy.state_dict()
        tensors = {"params": self.rounds.global_params}
        tensors.update({f"opt.{k}": v for k, v in opt.items() if isinstance(v, torch.Tensor)})
        state = {
            "mode": self.cfg.server.mode, "version": self.rounds.version, "round": self.rounds.round,
            "seed": self.rounds.seed, "spec_hash": self.spec.hash,
            "optimizer": {k: v for k, v in opt.items() if not isinstance(v, torch.Tensor)},
            "last_record": self.last_record,
        }
        return save_checkpoint(self.ckpt_dir, self.rounds.version, tensors, state, self.cfg.server.keep_checkpoints)

    def _restore(self, path: Path) -> None:
        tensors, state = load_checkpoint(path)
        if state.get("spec_hash") != self.spec.hash:
            raise ConfigError(
                f"checkpoint {path} holds a model with spec {state.get('spec_hash')!r}, the config builds "
                f"{self.spec.hash!r}: use the config it was made with, or another server.checkpoint_dir"
            )
        self.rounds.global_params = tensors["params"].clone()
        self.rounds.version = int(state["version"])
        self.rounds.round = int(state["round"])
        opt = dict(state["optimizer"])
        opt.update({k[4:]: v for k, v in tensors.items() if k.startswith("opt.")})
        self.rounds.strategy.load_state_dict(opt)
        self.last_record = state.get("last_record", {})
        self.resumed_from = path
        log.info("resumed from %s: version %d, round %d", path, self.rounds.version, self.rounds.round)

    # --- observability -------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        r = self.rounds
        return {
            "mode": self.cfg.server.mode, "round": r.round, "version": r.version,
            "rounds_target": self.cfg.server.rounds, "done": self.done, "round_open": r.open,
            "selected": sorted(r.selected) if r.open else [], "received": len(r.received) if r.open else 0,
            "connected_nodes": self.connected(now), "last_metrics": self.last_record,
            "spec_hash": self.spec.hash, "num_parameters": self.spec.numel,
            "updates_accepted": self.counters.accepted, "updates_rejected": dict(self.counters.rejected),
        }

    def prometheus(self, now: float) -> str:
        c = self.counters
        lines = [
            "# HELP shoal_version Current global model version.", "# TYPE shoal_version gauge",
            f"shoal_version {self.version}",
            "# HELP shoal_round Current round number.", "# TYPE shoal_round gauge",
            f"shoal_round {self.rounds.round}",
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
