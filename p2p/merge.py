"""Merge rules of gossip learning: how a peer folds a received model into its own.

A merge is ``own <- (1 - lam) * own + lam * other`` on the flat parameter vectors; the
rules differ in ``lam``:

- ``average``: lam = 1/2 (Ormandi, Hegedus and Jelasity 2013, "MU" merge);
- ``examples``: lam = n_other / (n_own + n_other), the two-model case of FedAvg's
  example weighting;
- ``age``: lam = a_other / (a_own + a_other), where the age is the number of local
  updates folded into a model (Hegedus, Danner and Jelasity 2019, "Gossip learning as a
  decentralized alternative to federated learning", the age-weighted merge).

A received model that is behind ours (a smaller age) is staler: its weight is multiplied
by ``(1 + gap) ** -staleness_exponent`` (the polynomial staleness function of FedAsync,
Xie et al. 2019), and a model more than ``max_age_gap`` behind is not merged at all. A
model more than ``max_age_gap`` *ahead* of ours replaces ours: that is how a peer that
restarted from scratch catches up in one exchange. The merged age is the larger of the
two (Ormandi et al.).

Robust merge. With ``norm_bound`` > 0 a received model farther than ``norm_bound`` (L2)
from ours is either

- ``clip``ped: ``own <- own + lam * clip(other - own, norm_bound)``, where clip scales a
  vector down to that norm. This is self-centered clipping (He, Karimireddy and Jaggi
  2022, "Byzantine-robust decentralized learning via self-centered clipping",
  arXiv:2202.01545) applied to one push-pull pair; or
- ``reject``ed: not merged at all (a distance screen, the parameter-space analogue of
  ``max_age_gap``).

Either way a hostile model moves ours by at most ``lam * norm_bound`` per merge,
whatever it contains and whatever age it claims (adopting a model far ahead is bounded
the same way). Clipping still lets every merge pull that far in the attacker's
direction, so attackers that merge often add up; rejection ignores the blatant ones
entirely (measured in docs/results.md). The bound should sit above the honest peers'
distances (the consensus distance metric shows them), or honest merges are cut too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RULES = ("average", "examples", "age")
BOUND_MODES = ("clip", "reject")


@dataclass(frozen=True)
class ModelInfo:
    """What a merge needs to know about a model besides its parameters."""

    age: int  # local updates folded in
    num_examples: int  # training examples behind the model (the owner's shard size)


@dataclass(frozen=True)
class MergeRule:
    rule: str = "age"
    staleness_exponent: float = 0.0  # 0: no staleness discount
    max_age_gap: int = 0  # 0: no limit
    norm_bound: float = 0.0  # > 0: bound ||other - own|| (L2) ...
    bound_mode: str = "clip"  # ... by clipping it, or by rejecting the model

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"merge rule {self.rule!r} is not one of {RULES}")
        if not self.norm_bound >= 0:
            raise ValueError(f"merge norm bound {self.norm_bound!r} must be >= 0")
        if self.bound_mode not in BOUND_MODES:
            raise ValueError(f"merge bound mode {self.bound_mode!r} is not one of {BOUND_MODES}")

    def bound(self, own: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(``other`` as the merge uses it, whether the bound acted): clipped so that
        ||other - own|| <= norm_bound, or None when the bound rejects it."""
        other = other.to(own.device, own.dtype)
        if self.norm_bound <= 0:
            return other, False
        diff = other - own
        norm = float(torch.linalg.vector_norm(diff))
        if norm <= self.norm_bound:
            return other, False
        if self.bound_mode == "reject":
            return None, True
        return own + diff * (self.norm_bound / norm), True

    def weight(self, own: ModelInfo, other: ModelInfo) -> float:
        """lam in [0, 1]: the share of the other model in the merge (1 = adopt it)."""
        gap = own.age - other.age
        if self.max_age_gap > 0:
            if gap > self.max_age_gap:
                return 0.0
            if -gap > self.max_age_gap:
                return 1.0
        if self.rule == "average":
            lam = 0.5
        elif self.rule == "examples":
            total = own.num_examples + other.num_examples
            lam = other.num_examples / total if total > 0 else 0.5
        else:
            total = own.age + other.age
            lam = other.age / total if total > 0 else 0.5
        if gap > 0 and self.staleness_exponent > 0:
            lam *= (1.0 + gap) ** -self.staleness_exponent
        return float(lam)

    def merge(
        self, own: torch.Tensor, own_info: ModelInfo, other: torch.Tensor, other_info: ModelInfo
    ) -> tuple[float, ModelInfo]:
        """Merge ``other`` into ``own`` in place; returns (lam, info of the merged model)."""
        lam = self.weight(own_info, other_info)
        if lam <= 0.0:
            return lam, own_info
        bounded, _ = self.bound(own, other)
        if bounded is None:
            return 0.0, own_info
        if lam >= 1.0:
            own.copy_(bounded)
            return lam, ModelInfo(other_info.age, own_info.num_examples)
        own.lerp_(bounded, lam)
        return lam, ModelInfo(max(own_info.age, other_info.age), own_info.num_examples)


# --- the safe-merge bound every algorithm applies by default ------------------------------------

WINDOW = 16  # senders whose latest distance sets the adaptive radius (one slot each)
HORIZON = 16  # local steps: a sender not heard from in this many of ours leaves the window
QUORUM = 2  # far senders it takes (and a majority of the live ones) to clip toward far models, not refuse them
FAR = 4.0  # refuse beyond FAR x max(tau, travelled) (gossip.merge_far, 4 by default; 0: clip however far)
BACK = 0.5  # a model whose difference from ours points back toward our start (cosine with our travel below
# -BACK) gets the far limit of the radius alone: undoing training is what a sign flip does, whatever its factor
SELF = ""  # the window's key for the length of our own last local step


def lower_median(values: list[float]) -> float:
    """The lower median (of two values, the smaller): with an honest majority of entries it is
    an honest value, and one entry alone can never raise it above the others."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


class MergeBound:
    """How far one received model (or one exchange's result) may move a peer's model.

    Always on unless set to 0 (``gossip.merge_bound``, ``gossip.merge_radius``,
    ``gossip.max_drift``, ``gossip.max_abs``), whatever ``robust.norm_bound`` says, because one
    hostile insider must never poison a peer, however many messages it sends:

    - a model with any value beyond ``max_abs`` in absolute value is refused outright;
    - self-centered clipping (He, Karimireddy and Jaggi 2022, "Byzantine-robust decentralized
      learning via self-centered clipping", arXiv:2202.01545): a neighbour's ``x_j - x_i``
      longer than the radius ``tau`` is clipped to it (``mode = "clip"``) or the model refused
      (``"reject"``). ``tau`` is ``radius`` when set, else ``relative x`` the lower median of a
      window of distances: the latest one of each of the last WINDOW senders heard from in our
      last ``horizon`` local steps (one slot per sender, so a sender that writes a thousand times
      still holds one entry, and a dead or departed one leaves) and the length of
      our own last local step (a scale no one else controls, and the floor of ``tau``: exact
      averages that leave neighbours identical cannot shrink it to nothing; before a peer's
      first local step ``tau`` is unbounded, so a fresh peer takes its neighbours' models at
      once, within ``max_abs``; one that trained first follows them by the vote below). Each
      entry is recorded already
      clipped to the ``tau`` in force, so a sender can lift the median only where honest
      entries already sit above it: ``tau`` tracks the honest spread, never the norm of our
      model or of the attacker's;
    - a model more than ``far x max(tau, travelled)`` away is refused, not clipped (a hard
      redescending influence: in ``x_j - x_i``'s direction a neighbour moves us by its distance
      up to ``tau``, by ``tau`` up to that limit, and not at all beyond). ``travelled`` is how far
      our model was from the one it started from (start()) at our last local step: the scale of
      what training does to a model, which no one else controls. An honest neighbour trained from
      the same start lies within the honest spread, or, where its data differ (a data-heavy
      peer whose local steps are several times ours, far beyond ``far x tau`` right after each
      of them), within a few times our travel; an attacker's ``x0 - 10 (x - x0)`` lies 11 times
      its own travel away, and hundreds of radii. A model whose difference from ours points back
      toward our start (:meth:`reach`: a sign flip of any factor does) gets ``far x tau`` alone.
      Clipping alone lets such a model pull every
      merge by ``tau`` in one consistent direction that the honest neighbours, pulled the same
      way, never pull back from: measured in docs/results.md, a sign-flipping insider then held
      the honest peers' accuracy 19 to 28 points below the honest peers' own. An insider that
      sends a model just inside the limit is clipped: it pulls by ``tau`` a merge, as under
      clipping alone, whatever the limit. Unless we
      are outvoted (:meth:`outvoted`): when most of the window's senders, and at least QUORUM,
      last sent a model beyond the far limit, it is we who are far from the neighbourhood (a
      restarted peer, one side of a healed partition, a peer that trained apart), and far models
      are clipped toward, as with ``far = 0``, until we are back among them. A minority insider
      never tips the vote; a majority of the window could already set ``tau``, and the most it
      gains here is clipping instead of refusal;
    - a drift budget: between two local steps, the merges together move our model by a path
      of at most ``drift x tau`` (a merge that would go farther is shortened), so the many
      merges of a flood add up to no more than a few honest ones.

    Stateful (the window and the budget), one per peer; sans-I/O.
    """

    def __init__(
        self,
        relative: float = 2.0,
        max_abs: float = 1e4,
        mode: str = "clip",
        radius: float = 0.0,
        drift: float = 4.0,
        window: int = WINDOW,
        far: float = FAR,
        horizon: int = HORIZON,
        quorum: int = QUORUM,
    ):
        checks = (("merge bound", relative), ("max_abs", max_abs), ("radius", radius), ("drift", drift), ("far", far))
        for name, v in checks:
            if not v >= 0:
                raise ValueError(f"{name} {v!r} must be >= 0")
        if mode not in BOUND_MODES:
            raise ValueError(f"merge bound mode {mode!r} is not one of {BOUND_MODES}")
        if window < 1 or horizon < 1:
            raise ValueError(f"merge bound window {window!r} and horizon {horizon!r} must be >= 1")
        self.relative, self.max_abs, self.mode = float(relative), float(max_abs), mode
        self.fixed, self.drift, self.window = float(radius), float(drift), int(window)
        self.far = max(float(far), 1.0) if far > 0 else 0.0  # 0: clip however far (mode "clip")
        self.horizon, self.quorum = int(horizon), int(quorum)  # quorum: far votes it takes to follow
        self.origin: torch.Tensor | None = None  # the model we started from (start()): one more copy of it
        self.travelled = 0.0  # how far our model was from it at our last local step
        self.distances: dict[str, float] = {}  # sender -> its latest distance (clipped); insertion order = recency
        self.heard: dict[str, int] = {}  # sender -> our local step count when its distance was recorded
        self.beyond: set[str] = set()  # senders whose latest model lay beyond the far limit
        self.steps = 0  # our local steps so far
        self.followed = 0  # models beyond the far limit clipped, not refused: most live senders were that far
        self.spent = 0.0  # path length merges moved us since our last local step
        self.clipped = 0
        self.refused = 0
        self.capped = 0  # merges shortened by the drift budget

    @property
    def active(self) -> bool:
        return self.relative > 0 or self.fixed > 0 or self.max_abs > 0

    def within_max_abs(self, other: torch.Tensor) -> bool:
        """True when every value of ``other`` is finite and within ``max_abs`` (0: finite only)."""
        if not bool(torch.isfinite(other).all()):
            return False
        return self.max_abs <= 0 or other.numel() == 0 or float(other.abs().max()) <= self.max_abs

    def radius(self) -> float:
        """``tau``: the longest ``x_j - x_i`` merged as it is (inf when off)."""
        if self.fixed > 0:
            return self.fixed
        if self.relative <= 0:
            return float("inf")
        own = self.distances.get(SELF)
        if own is None:  # no local step yet: a fresh peer catches up with its neighbours at once
            return float("inf")
        return self.relative * max(own, lower_median(list(self.distances.values())))

    def limit(self, own: torch.Tensor | None = None) -> float:
        """The largest distance a received model may have from ours (``radius()``)."""
        return self.radius()

    def _record(self, sender: str, dist: float) -> None:
        self.distances.pop(sender, None)
        self.distances[sender] = dist
        self.heard[sender] = self.steps
        while len(self.distances) > self.window:
            self._forget(next(k for k in self.distances if k != SELF))

    def _forget(self, sender: str) -> None:
        self.distances.pop(sender, None)
        self.heard.pop(sender, None)
        self.beyond.discard(sender)

    def reset(self) -> None:
        """Forget the window (our model was reset): unbounded again until the next local step."""
        self.distances.clear()
        self.heard.clear()
        self.beyond.clear()
        self.spent = 0.0
        self.origin, self.travelled = None, 0.0

    def start(self, params: torch.Tensor) -> None:
        """Our model starts (again) from ``params``: how far training has taken it is measured from here."""
        self.origin = params.detach().clone()
        self.travelled = 0.0

    def _from_start(self, own: torch.Tensor) -> torch.Tensor | None:
        """``own - origin`` in double (None when we have no start of its shape)."""
        if self.origin is None or self.origin.shape != own.shape:
            return None
        return (own - self.origin.to(own.device, own.dtype)).double()

    def travel(self, own: torch.Tensor) -> float:
        """How far ``own`` is from where we started (0 when unknown)."""
        v = self._from_start(own)
        return 0.0 if v is None else float(torch.linalg.vector_norm(v))

    def reach(self, own: torch.Tensor, diff: torch.Tensor, dist: float) -> float:
        """The travel :meth:`far_limit` may count for a model ``diff`` away from ``own``: ours, or 0
        when ``diff`` points back toward where we started (its cosine with ``own - origin`` below
        -BACK), so that such a model is held to ``far x tau`` alone."""
        if dist <= 0 or self.travelled <= 0:
            return self.travelled
        v = self._from_start(own)
        if v is None:
            return self.travelled
        nv = float(torch.linalg.vector_norm(v))
        if nv <= 0:
            return self.travelled
        cos = float(torch.dot(diff.double().flatten(), v.flatten())) / (dist * nv)
        return 0.0 if cos < -BACK else self.travelled

    def far_limit(self, limit: float, travelled: float | None = None) -> float:
        """The distance beyond which a model is refused, not clipped: ``far x`` the larger of the
        radius ``limit`` and how far our model has come from where it started (``travelled``, by
        default as of our last local step)."""
        return self.far * max(limit, self.travelled if travelled is None else travelled)

    def local_step(self, length: float, model: torch.Tensor | None = None) -> None:
        """Our own training moved us by ``length``: it enters the window, the drift budget restarts,
        and senders not heard from in the last ``horizon`` local steps leave the window (a dead
        or departed neighbour's old distance no longer holds ``tau`` where it was)."""
        self.steps += 1
        if model is not None:
            travelled = self.travel(model)
            self.travelled = travelled if math.isfinite(travelled) else self.travelled
        if math.isfinite(length):
            self._record(SELF, float(length))
        for sender in [k for k, at in self.heard.items() if k != SELF and at < self.steps - self.horizon]:
            self._forget(sender)
        self.spent = 0.0

    def observe(self, sender: str, dist: float, travelled: float | None = None) -> None:
        """``sender``'s model was ``dist`` from ours: its slot of the window, clipped to ``tau``,
        and whether it lay beyond :meth:`far_limit` (with ``travelled`` as :meth:`shrink` will
        use it: its vote in :meth:`outvoted`)."""
        if sender == SELF or not math.isfinite(dist):
            return
        tau = self.radius()
        if self.far > 0 and dist > self.far_limit(tau, travelled):
            self.beyond.add(sender)
        else:
            self.beyond.discard(sender)
        self._record(sender, min(float(dist), tau))

    def outvoted(self) -> bool:
        """True when most of the live senders (those in the window: heard from in the last
        ``horizon`` local steps; our own step does not vote) last sent a model beyond
        the far limit: then it is we who are far from the neighbourhood (a restarted peer, a peer
        that trained apart for a while, one side of a healed partition), and far models are
        clipped toward, not refused. One sender is one vote however often it writes, so an
        insider that is a minority of the window never tips it, and a lone far sender never
        does (QUORUM: with one neighbour heard, who is the outlier cannot be told)."""
        live = len(self.distances) - (SELF in self.distances)
        return len(self.beyond) >= max(self.quorum, 1) and 2 * len(self.beyond) > live

    def shrink(self, dist: float, limit: float, travelled: float | None = None) -> float | None:
        """The factor a difference of length ``dist`` is scaled by under the radius ``limit``:
        1 within it, ``limit / dist`` when clipped, None when refused (beyond :meth:`far_limit`,
        or beyond ``limit`` in reject mode). Counts what it did."""
        if not dist > limit:
            return 1.0
        if self.mode == "reject":
            self.refused += 1
            return None
        if self.far > 0 and dist > self.far_limit(limit, travelled):
            if not self.outvoted():
                self.refused += 1
                return None
            self.followed += 1
        self.clipped += 1
        return limit / dist

    def apply(self, own: torch.Tensor, other: torch.Tensor, sender: str | None = None) -> torch.Tensor | None:
        """``other`` as it may be merged into ``own``: unchanged, clipped to ``tau``, or None when
        refused (beyond ``max_abs``, beyond the far limit, or beyond ``tau`` in reject mode). With ``sender`` its
        distance takes that sender's slot of the window. Counts what it did."""
        other = other.to(own.device, own.dtype)
        if not self.within_max_abs(other):
            self.refused += 1
            return None
        limit = self.radius()
        if math.isinf(limit):
            return other
        diff = other - own
        dist = float(torch.linalg.vector_norm(diff.double()))
        reach = self.reach(own, diff, dist)
        if sender is not None:
            self.observe(sender, dist, reach)
        factor = self.shrink(dist, limit, reach)
        if factor is None or factor == 1.0:
            return None if factor is None else other
        return own + diff * factor

    def allow(self, length: float) -> float:
        """The share in [0, 1] of a step of ``length`` that the drift budget still allows; spends it."""
        if self.drift <= 0 or length <= 0:
            return 1.0
        cap = self.drift * self.radius()
        if math.isinf(cap):
            return 1.0
        left = max(cap - self.spent, 0.0)
        share = 1.0 if length <= left else left / length
        if share < 1.0:
            self.capped += 1
        self.spent += share * length
        return share

    def move(self, own: torch.Tensor, target: torch.Tensor, lam: float) -> float:
        """``own <- own + lam' (target - own)`` in place, with ``lam' <= lam`` cut to the drift
        budget; returns ``lam'``."""
        if lam <= 0:
            return 0.0
        length = lam * float(torch.linalg.vector_norm((target - own).double()))
        lam *= self.allow(length)
        if lam >= 1.0:
            own.copy_(target)
        elif lam > 0:
            own.lerp_(target, lam)
        return lam
