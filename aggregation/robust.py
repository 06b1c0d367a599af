"""Robust aggregation rules: drop-in replacements for :class:`WeightedMean`.

Each rule has the same ``add(delta, weight) / mean() / reset() / count`` interface, so
it plugs into :class:`~shoal.aggregation.Strategy` for sync rounds, into a FedBuff
buffer (the buffer's updates are the rule's inputs, the staleness factor its weight) and
into a gossip merge (add the neighbours' vectors, take ``mean()``).

Memory note. Norm bounding is streaming (O(model)). The median, the trimmed mean and
Krum need every update of the round at once: they keep a bounded buffer of at most
``max_updates`` float32 copies, i.e. ``n x model`` floats (20 clients x a 1.7M-parameter
CNN = 136 MB). :meth:`_BufferedRule.add` refuses update ``max_updates + 1`` with a clear
error rather than growing without limit. The rules work on column slices of that buffer
(``_COLUMNS`` coordinates at a time), so no second ``n x model`` copy is made.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from shoal.config import RobustConfig

from .mean import EmptyAggregate, WeightedMean

if TYPE_CHECKING:
    from .strategy import Aggregator

_COLUMNS = 1 << 16  # coordinates per slice when a rule sorts or multiplies across clients


class _BufferedRule:
    """Holds the round's updates (bounded) and combines them in :meth:`mean`."""

    def __init__(self, numel: int, device: torch.device | str = "cpu", max_updates: int = 1024):
        if numel <= 0:
            raise ValueError(f"numel = {numel} must be > 0")
        if max_updates <= 0:
            raise ValueError(f"max_updates = {max_updates} must be > 0")
        self.numel = numel
        self.device = torch.device(device)
        self.max_updates = max_updates
        self._deltas: list[torch.Tensor] = []
        self._weights: list[float] = []

    @property
    def count(self) -> int:
        return len(self._deltas)

    def reset(self) -> None:
        self._deltas.clear()
        self._weights.clear()

    def add(self, delta: torch.Tensor, weight: float) -> None:
        if delta.shape != (self.numel,):
            raise ValueError(f"delta has shape {tuple(delta.shape)}, expected ({self.numel},)")
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight = {weight!r} must be a finite number > 0")
        if self.count >= self.max_updates:
            raise ValueError(
                f"{type(self).__name__} already holds {self.count} updates (robust.max_updates): "
                "raise the limit if memory allows, or close the round sooner"
            )
        # A copy: the caller may reuse its tensor after add() returns.
        self._deltas.append(delta.detach().to(self.device, torch.float32, copy=True))
        self._weights.append(float(weight))

    def _columns(self):
        """(start, end, n x (end-start) slice) over the coordinates, one slice at a time."""
        for a in range(0, self.numel, _COLUMNS):
            b = min(a + _COLUMNS, self.numel)
            yield a, b, torch.stack([d[a:b] for d in self._deltas])

    def mean(self) -> torch.Tensor:
        if self.count == 0:
            raise EmptyAggregate("no update was added: there is nothing to aggregate")
        return self._combine()

    def _combine(self) -> torch.Tensor:
        raise NotImplementedError


class CoordinateMedian(_BufferedRule):
    """Coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning:
    Towards Optimal Statistical Rates", ICML). Unweighted: a weight would let one client
    claim many examples and move the median. For even n, the mean of the two middle values."""

    def _combine(self) -> torch.Tensor:
        n = self.count
        out = torch.empty(self.numel, device=self.device, dtype=torch.float32)
        for a, b, cols in self._columns():
            s = cols.sort(dim=0).values
            out[a:b] = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
        return out


class TrimmedMean(_BufferedRule):
    """Coordinate-wise beta-trimmed mean (Yin et al. 2018): per coordinate, drop the
    floor(beta*n) largest and smallest values and average the rest. Unweighted, as above."""

    def __init__(self, numel: int, beta: float, device: torch.device | str = "cpu", max_updates: int = 1024):
        super().__init__(numel, device, max_updates)
        if not 0 <= beta < 0.5:
            raise ValueError(f"trim beta = {beta} must be in [0, 0.5)")
        self.beta = beta

    def _combine(self) -> torch.Tensor:
        n = self.count
        t = int(math.floor(self.beta * n))
        out = torch.empty(self.numel, device=self.device, dtype=torch.float32)
        for a, b, cols in self._columns():
            s = cols.sort(dim=0).values
            out[a:b] = s[t : n - t].double().mean(dim=0).float()
        return out


class MultiKrum(_BufferedRule):
    """Krum and Multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries:
    Byzantine Tolerant Gradient Descent", NeurIPS).

    With n updates of which at most f are Byzantine (the paper needs n > 2f + 2), the
    score of update i is the sum of squared distances to its n - f - 2 nearest other
    updates. Krum (m = 1) returns the update of lowest score; Multi-Krum averages the m
    lowest-scoring ones (weighted by their weights; m = 0 means n - f).
    """

    def __init__(self, numel: int, f: int, m: int = 1, device: torch.device | str = "cpu", max_updates: int = 1024):
        super().__init__(numel, device, max_updates)
        if f < 0 or m < 0:
            raise ValueError(f"krum f = {f} and m = {m} must be >= 0")
        self.f = f
        self.m = m

    def scores(self) -> torch.Tensor:
        """Krum score of each buffered update (float64)."""
        n, f = self.count, self.f
        if n <= 2 * f + 2:
            raise ValueError(
                f"Krum with f = {f} needs more than 2f + 2 = {2 * f + 2} updates, got {n} "
                "(lower robust.krum_f or select more clients per round)"
            )
        gram = torch.zeros(n, n, dtype=torch.float64, device=self.device)
        for _, _, cols in self._columns():
            c = cols.double()
            gram += c @ c.T
        sq = gram.diagonal()
        dist = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min_(0)
        dist.fill_diagonal_(math.inf)
        nearest = dist.topk(n - f - 2, dim=1, largest=False).values
        return nearest.sum(dim=1)

    def selected(self) -> list[int]:
        """Indices (in add order) of the m updates Multi-Krum keeps, best score first."""
        m = self.m or self.count - self.f
        order = torch.argsort(self.scores(), stable=True)
        return [int(i) for i in order[: min(m, self.count)]]

    def _combine(self) -> torch.Tensor:
        keep = self.selected()
        acc = WeightedMean(self.numel, self.device)
        for i in keep:
            acc.add(self._deltas[i], self._weights[i])
        return acc.mean()


class NormBound:
    """Clip each update to L2 norm <= ``bound`` before an inner rule (Sun et al. 2019,
    "Can You Really Backdoor Federated Learning?"). Streaming: nothing is kept but the
    inner rule's state. ``clipped`` counts the updates scaled down since the last reset."""

    def __init__(self, inner: Aggregator, bound: float):
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"norm bound = {bound!r} must be a finite number > 0")
        self.inner = inner
        self.bound = bound
        self.clipped = 0

    @property
    def count(self) -> int:
        return self.inner.count

    def reset(self) -> None:
        self.inner.reset()
        self.clipped = 0

    def add(self, delta: torch.Tensor, weight: float) -> None:
        norm = float(torch.linalg.vector_norm(delta.float()))
        if norm > self.bound:
            delta = delta * (self.bound / norm)
            self.clipped += 1
        self.inner.add(delta, weight)

    def mean(self) -> torch.Tensor:
        return self.inner.mean()


def make_aggregator(cfg: RobustConfig, numel: int, device: torch.device | str = "cpu") -> Aggregator:
    """The aggregation rule a ``[robust]`` table names, with norm bounding in front if set."""
    rule: Aggregator
    match cfg.rule:
        case "mean":
            rule = WeightedMean(numel, device)
        case "median":
            rule = CoordinateMedian(numel, device, cfg.max_updates)
        case "trimmed_mean":
            rule = TrimmedMean(numel, cfg.trim_beta, device, cfg.max_updates)
        case "krum":
            rule = MultiKrum(numel, cfg.krum_f, 1, device, cfg.max_updates)
        case "multikrum":
            rule = MultiKrum(numel, cfg.krum_f, cfg.multikrum_m, device, cfg.max_updates)
        case _:
            raise ValueError(f"robust.rule = {cfg.rule!r} is not a known rule")
    return NormBound(rule, cfg.norm_bound) if cfg.norm_bound > 0 else rule
