"""Streaming weighted mean of flat client deltas: memory O(model), not O(clients x model).

The sum is kept in float64 by default. Summing n float32 deltas in float32 loses up to
~n*eps relative to the sum of magnitudes, and much more relative to a mean near zero
(client deltas cancel); in float64 the result, rounded once to float32 in :meth:`mean`,
is the float32 rounding of the exact weighted mean for any practical n. It also makes
the mean independent of arrival order (up to that final rounding), so an async server
and a simulation that see the same updates in different orders agree. The cost is one
float64 model-sized buffer; pass ``dtype=torch.float32`` where float64 is unavailable
(Apple MPS) or memory is tight.

A float32 sum of K weighted deltas is summed in arrival order, so each coordinate's error is
at most about ``(K - 1) * 2**-24 * sum_i w_i |delta_i| / sum_i w_i`` (the bound of recursive
summation), i.e. relative to the mean of the magnitudes, not to the mean itself; K = 10 gives
at most ~5e-7 of that. With a float32 sum :meth:`take_mean` divides the sum in place and hands
its memory over as the mean, so the server's peak is the model plus one float32 buffer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

#: Elements widened at once when a delta's dtype is narrower than the sum's: 2 MiB of float64,
#: which stays in cache; torch's mixed-dtype in-place add is slower than a copy and an add.
BLOCK = 1 << 18


class EmptyAggregate(RuntimeError):
    """A mean was asked of nothing: no update was added since the last reset.

    A caller's bug, not a user's: a server checks ``count`` (or the strategy's
    ``num_accumulated``) before closing a round, and keeps the old model if it is 0.
    """


class WeightedMean:
    """``sum_i w_i * delta_i / sum_i w_i``, one :meth:`add` at a time.

    Holds one accumulator tensor (freed by :meth:`release` until the next :meth:`reset` or add,
    so a strategy lets it go at a round's end once the mean is taken); nothing keeps a
    reference to an added delta.
    """

    def __init__(self, numel: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64):
        if numel <= 0:
            raise ValueError(f"numel = {numel} must be > 0")
        self.numel = numel
        self._device = torch.device(device)
        self._dtype = dtype
        self._acc: torch.Tensor | None = None
        self.total_weight = 0.0
        self.count = 0
        self._block: torch.Tensor | None = None  # a block of a delta widened to the sum's dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def _sum(self) -> torch.Tensor:
        """The running sum (zeros until something is added)."""
        if self._acc is None:
            self._acc = torch.zeros(self.numel, device=self._device, dtype=self._dtype)
        return self._acc

    def reset(self) -> None:
        self._sum.zero_()
        self.total_weight = 0.0
        self.count = 0

    def release(self) -> None:
        """:meth:`reset`, and the sum's memory given back (made again, zeroed, when next used)."""
        self._acc = None
        self.total_weight = 0.0
        self.count = 0

    def add(self, delta: torch.Tensor, weight: float) -> None:
        if delta.shape != (self.numel,):
            raise ValueError(f"delta has shape {tuple(delta.shape)}, expected ({self.numel},)")
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight = {weight!r} must be a finite number > 0")
        delta = delta.to(self.device)
        if delta.dtype == self._sum.dtype:
            self._sum.add_(delta, alpha=weight)
        else:  # widen a block at a time: no model-sized temporary, and faster than a mixed-dtype add
            if self._block is None:
                self._block = torch.empty(min(self.numel, BLOCK), device=self.device, dtype=self._sum.dtype)
            for start in range(0, self.numel, BLOCK):
                end = min(start + BLOCK, self.numel)
                wide = self._block[: end - start].copy_(delta[start:end])
                self._sum[start:end].add_(wide, alpha=weight)
        self.total_weight += float(weight)
        self.count += 1

    def add_blocks(self, blocks: Iterable[torch.Tensor], weight: float) -> None:
        """Add one delta that arrives as consecutive flat pieces (any float dtype), e.g. read back a
        block at a time from a staged upload: the same sum as :meth:`add` of their concatenation,
        with no model-sized copy. The pieces must cover the model exactly; the caller checked
        them (a piece that fails midway leaves a partial sum: the caller drops the round)."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight = {weight!r} must be a finite number > 0")
        start = 0
        for piece in blocks:
            end = start + piece.numel()
            if end > self.numel:
                raise ValueError(f"the pieces hold more than the model's {self.numel} values")
            self._add_range(start, piece.reshape(-1).to(self.device), weight)
            start = end
        if start != self.numel:
            raise ValueError(f"the pieces hold {start} values, the model {self.numel}")
        self.total_weight += float(weight)
        self.count += 1

    def _add_range(self, start: int, piece: torch.Tensor, weight: float) -> None:
        """``sum[start:start + len(piece)] += weight * piece``, widened a cache-sized block at a time."""
        if piece.dtype == self._sum.dtype:
            self._sum[start : start + piece.numel()].add_(piece, alpha=weight)
            return
        if self._block is None:
            self._block = torch.empty(min(self.numel, BLOCK), device=self.device, dtype=self._sum.dtype)
        for a in range(0, piece.numel(), BLOCK):
            b = min(a + BLOCK, piece.numel())
            wide = self._block[: b - a].copy_(piece[a:b])
            self._sum[start + a : start + b].add_(wide, alpha=weight)

    def add_sum(self, weighted_sum: torch.Tensor, total_weight: float, count: int) -> None:
        """Add ``count`` updates summed elsewhere (``sum_i w_i delta_i`` and ``sum_i w_i``): the same
        state as adding each, up to float64 summation order (a Ray worker's partial sum)."""
        if weighted_sum.shape != (self.numel,):
            raise ValueError(f"weighted sum has shape {tuple(weighted_sum.shape)}, expected ({self.numel},)")
        if count <= 0 or not (total_weight > 0 and math.isfinite(total_weight)):
            raise ValueError(f"a partial sum of {count} updates with total weight {total_weight!r}: need both > 0")
        self._sum.add_(weighted_sum.to(self.device, self._sum.dtype))
        self.total_weight += float(total_weight)
        self.count += count

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def take_mean(self) -> torch.Tensor:
        """The weighted mean as a float32 vector that the caller owns. A float32 sum is divided in
        place and handed over (no second model-sized buffer; the aggregator is released, as by
        :meth:`release`); a float64 sum gives :meth:`mean` and keeps its state."""
        if self._dtype != torch.float32:
            return self.mean()
        if self.count == 0:
            raise EmptyAggregate("no update was added: there is nothing to average")
        out = self._sum.div_(self.total_weight)
        self.release()
        return out

    def mean(self) -> torch.Tensor:
        """The weighted mean as a new float32 vector (the dtype of the parameter buffer), divided
        a block at a time (no sum-sized temporary: for a float64 sum that is twice the model)."""
        if self.count == 0:
            raise EmptyAggregate("no update was added: there is nothing to average")
        out = torch.empty(self.numel, device=self.device, dtype=torch.float32)
        for a in range(0, self.numel, BLOCK):
            b = min(a + BLOCK, self.numel)
            out[a:b].copy_(self._sum[a:b] / self.total_weight)
        return out
