"""What an upload must be before it may touch a round, checked without any round state: its
size, its decoding against the model's spec (with the value bounds the operator set), the tensors
the algorithm's server step takes beside it, and whether a chunked upload may be summed a block at
a time. ServerService (server/service.py) asks these before it hands an update to its rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast

import torch

from shoal.aggregation.mean import WeightedMean
from shoal.aggregation.secagg.encoding import FixedPoint
from shoal.aggregation.strategy import Strategy
from shoal.algorithms import algorithm_of
from shoal.config import Config
from shoal.errors import Malformed, ShoalError, SpecMismatch
from shoal.params import ParamSpec
from shoal.rounds import SyncRounds
from shoal.update import Update
from shoal.wire import MAX_HEADER_BYTES, UpdateStream, decode_update, read_header

from .node_reports import spec_mismatch_detail


class UploadChecks:
    """The stateless checks of one server's uploads (``cfg``'s bounds, ``spec``'s model)."""

    def __init__(self, cfg: Config, spec: ParamSpec):
        s = cfg.server
        self.cfg, self.spec = cfg, spec
        self.algorithm = algorithm_of(cfg)
        # the largest update (a dense float32 model and its header; an algorithm's extra tensors,
        # SCAFFOLD's control-variate delta, are model-sized too), and the largest request: an update
        # over max_body_bytes travels in chunks (server/chunks.py)
        sent = 1 + len(self.algorithm.to_server)
        self.update_limit = max(s.max_body_bytes, sent * spec.nbytes + MAX_HEADER_BYTES)
        self.max_body_bytes = s.max_body_bytes or spec.nbytes + MAX_HEADER_BYTES
        if cfg.secure_aggregation.enabled and s.clients_per_round:  # the headroom check, before any round
            sa = cfg.secure_aggregation
            FixedPoint(sa.clip, sa.bits, math.ceil(s.clients_per_round * (1 + cfg.asynchronous.over_selection)))

    def decode(self, body: bytes | memoryview) -> tuple[Update, dict[str, Any]]:
        """The update and header of a whole body (a writable ``body`` is decoded in place); a
        ShoalError if it is not one of this model's updates within the operator's bounds."""
        s = self.cfg.server
        try:
            return decode_update(
                body, self.spec, self.update_limit, copy=False, max_examples=s.max_examples, max_abs=s.max_delta_abs
            )
        except SpecMismatch:
            sent = sent_spec_hash(body, self.update_limit)
            if isinstance(sent, str) and sent != self.spec.hash:
                raise SpecMismatch(spec_mismatch_detail(sent[:64], self.spec.hash)) from None
            raise

    def stream(self, size: int) -> UpdateStream:
        """The checker of one chunked upload of ``size`` bytes, fed as its chunks arrive."""
        s = self.cfg.server
        return UpdateStream(self.spec, size, self.update_limit, s.max_examples, s.max_delta_abs)

    @staticmethod
    def streamable(stream: UpdateStream, rounds: SyncRounds | None) -> bool:
        """A complete chunked upload may enter the round's sum a block at a time (no model-sized
        copy): its values were checked as they arrived, and the round sums plain weighted means
        (not a robust rule, a DP mean or an async buffer, which look at each update whole)."""
        return (
            stream.complete
            and stream.dtype is not None
            and rounds is not None
            and type(rounds.strategy) is Strategy
            and type(rounds.strategy.aggregator) is WeightedMean
        )

    def check_algorithm_fields(self, update: Update) -> None:
        """What the algorithm's server step needs beside the update is there (Malformed, nothing
        changed, otherwise); nothing an algorithm does not use may come with it."""
        declared = self.algorithm
        wanted = set(declared.to_server)
        if set(update.to_server) != wanted:
            raise Malformed(
                f"the update carries {sorted(update.to_server)} beside its delta; algorithm.name = "
                f"{declared.name!r} takes {sorted(wanted)}"
            )
        if "fednova_a" in declared.reports:
            a = update.metrics.get("fednova_a", 0.0)
            if not (a >= 1.0 and math.isfinite(a)):
                raise Malformed(f"FedNova's update needs metrics.fednova_a >= 1 (its local steps' weight), got {a!r}")


class StagedBlocks:
    """The blocks of a staged update, noting whether the sum has begun taking them."""

    def __init__(self, blocks: Iterator[torch.Tensor]):
        self.blocks = blocks
        self.started = False

    def __iter__(self) -> Iterator[torch.Tensor]:
        for piece in self.blocks:
            self.started = True
            yield piece


def sent_spec_hash(body: bytes | memoryview, max_bytes: int) -> Any:
    """The spec hash an upload's header claims (None if the header cannot be read)."""
    try:
        return read_header(cast(bytes, body), max_bytes)[0].get("spec_hash")  # read_header takes any buffer
    except ShoalError:
        return None
