"""The simulated network hop: every update is encoded as a client would send it
(compressed per ``[compression]``), counted in bytes, then decoded and validated as the
server would. A payload that fails validation raises its WireError, which the
simulator counts as a rejection (nothing is aggregated). The global model's broadcast
is counted once per selected client (``bytes_down``).

Error feedback (top-k): the engine reports each upload's outcome with :meth:`WireStep.accepted`
or :meth:`WireStep.not_accepted` (refused, late and dropped, in an aborted or failed round, or
never delivered); a payload refused by validation here is folded back at once.
"""

from __future__ import annotations

import torch

from shoal.aggregation.compression import Compressor, Residuals
from shoal.config import CompressionConfig
from shoal.params import ParamSpec
from shoal.rounds import Assignment
from shoal.update import Update
from shoal.wire import decode_update, encode_model, encode_update


class WireStep:
    """A client step (last in the pipeline) that round-trips updates through shoal.wire."""

    def __init__(self, cfg: CompressionConfig, spec: ParamSpec, residuals: Residuals | None = None):
        self.cfg = cfg
        self.spec = spec
        self.compressor = Compressor(cfg, residuals)  # top-k residuals: a dict, or a store's view
        self.bytes_up = self.bytes_down = 0  # this round
        self.total_up = self.total_down = 0  # since the start
        self._model_size: tuple[int, int] | None = None  # (version, bytes) of the last model encoded
        self._tags: dict[str, tuple[int, int]] = {}  # client -> the tag of its upload in flight

    def broadcast(self, global_params: torch.Tensor, version: int, receivers: int) -> None:
        """Count the model download of a new round (dense float32 model message)."""
        size = len(encode_model(global_params, self.spec, version)) * receivers
        self.bytes_up, self.bytes_down = 0, size
        self.total_down += size

    def download(self, global_params: torch.Tensor, version: int) -> None:
        """Count one client's model download without starting a round (async: each task
        fetches the current version alone). The model is encoded once per version."""
        if self._model_size is None or self._model_size[0] != version:
            self._model_size = (version, len(encode_model(global_params, self.spec, version)))
        self.bytes_down += self._model_size[1]
        self.total_down += self._model_size[1]

    def __call__(self, task: Assignment, update: Update) -> Update:
        tag = (task.round, task.seed)
        self._tags[task.client_id] = tag
        payload = self.compressor.encode(update.delta, task.client_id, task.seed, tag)
        body = encode_update(update, self.spec, payload=payload, zstd_level=self.cfg.zstd_level if self.cfg.zstd else 0)
        self.bytes_up += len(body)
        self.total_up += len(body)
        try:
            received, _ = decode_update(body, self.spec)
        except Exception:
            self.not_accepted(task.client_id)  # the server refuses it: nothing of it was delivered
            raise
        received.delta = received.delta.to(update.delta.device)
        return received

    def count_up(self, nbytes: int) -> None:
        """Count uploads encoded elsewhere (a Ray worker's round trip of the clients it summed)."""
        self.bytes_up += nbytes
        self.total_up += nbytes

    def accepted(self, client: str) -> None:
        """``client``'s upload in flight was applied (top-k: its sent coordinates are delivered)."""
        tag = self._tags.pop(client, None)
        if tag is not None:
            self.compressor.accepted(client, tag)

    def not_accepted(self, client: str) -> None:
        """``client``'s upload in flight was refused, dropped as late, aborted or never sent."""
        tag = self._tags.pop(client, None)
        if tag is not None:
            self.compressor.not_accepted(client, tag)

    def counts(self) -> dict[str, int]:
        return {
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "bytes_up_total": self.total_up,
            "bytes_down_total": self.total_down,
        }
