"""epsilon against the aggregator itself (distributed DP under secure aggregation): no amplification
by a sample the server chose and saw (:class:`ServerViewAccountant`)."""

from __future__ import annotations

import json
import math
from functools import lru_cache

from shoal.accounting import LEDGER_ORDERS, gaussian_epsilon, rdp_to_epsilon
from shoal.accounting_ddg import DDG_KEYS, ddg_round_gaussian
from shoal.accounting_rounds import DdgRoundAccountant


class ServerViewAccountant:
    """epsilon against the aggregator itself, for distributed DP under secure aggregation.

    Amplification by sampling needs the sample to be secret; the server chose it and ran the
    protocol with the survivors, so it knows in which rounds a node took part. Against it a node's
    rounds are unsampled mechanisms, composed over the rounds the node took part in (selected, also
    if it then dropped): each a Gaussian of multiplier z on the sum of at least t shares (z/2 under
    fixed-size sampling, whose replace-one sensitivity is 2C), or one round of the distributed
    discrete Gaussian's bound without subsampling. The server's own top-up noise and the noised
    round figures (which the server computes) count for nothing here. The reported figure is the
    worst node's; a node never selected has spent nothing. This holds for any selection that does
    not look at the data, a malicious server's included (it can only select a node more often, and
    each selection is counted).

    Per node it keeps what is needed to price its rounds exactly: ``rho`` = sum of 1/z^2 over its
    Gaussian rounds (k Gaussians of multipliers z_i compose to one of multiplier rho^-1/2) and the
    count of its discrete-Gaussian rounds per parameter set."""

    def __init__(self, delta: float, kind: str = "rdp", *, replace_one: bool = False):
        self.delta, self.kind, self.replace_one = delta, kind, replace_one
        self.z = 0.0
        self.ddg: dict | None = None
        self.nodes: dict[str, dict] = {}  # node -> {"rho": float, "ddg": {params json: rounds}}

    def set_mechanism(self, z: float = 0.0, ddg: dict | None = None) -> None:
        """The next rounds' per-participation mechanism: a Gaussian of multiplier ``z`` on the sum, or
        the discrete Gaussian of parameters ``ddg`` (DdgRoundAccountant's, with ``sensitivity_sq``)."""
        self.z = float(z)
        self.ddg = {k: ddg[k] for k in DDG_KEYS} if ddg is not None else None

    def _step(self) -> tuple[float, str | None]:
        if self.ddg is not None:
            return 0.0, json.dumps(self.ddg, sort_keys=True)
        z = self.z / 2 if self.replace_one else self.z
        return (math.inf if z <= 0 else z**-2), None

    @staticmethod
    def _add(state: dict, step: tuple[float, str | None]) -> dict:
        rho, key = step
        ddg = dict(state.get("ddg", {}))
        if key is not None:
            ddg[key] = ddg.get(key, 0) + 1
        return {"rho": float(state.get("rho", 0.0)) + rho, "ddg": ddg}

    def record_round(self, participants: list[str]) -> None:
        """One round in which these nodes were selected (charged whether or not they delivered)."""
        step = self._step()
        for node in set(participants):
            self.nodes[node] = self._add(self.nodes.get(node, {}), step)

    def _price(self, rho: float, ddg: tuple[tuple[str, int], ...]) -> float:
        return server_view_epsilon(rho, ddg, self.delta, self.kind)

    def _states(self) -> set[tuple[float, tuple[tuple[str, int], ...]]]:
        return {(s["rho"], tuple(sorted(s["ddg"].items()))) for s in self.nodes.values()}

    @property
    def epsilon(self) -> float:
        """The worst node's epsilon against the server (0 before anyone took part)."""
        return max((self._price(*s) for s in self._states()), default=0.0)

    def next_epsilon(self) -> float:
        """The worst node's epsilon should it take part in one more round (a node new to the run too)."""
        step = self._step()
        states = [{"rho": r, "ddg": dict(d)} for r, d in self._states()] or [{}]
        nxt = [self._add(s, step) for s in states]
        return max(self._price(s["rho"], tuple(sorted(s["ddg"].items()))) for s in nxt)

    def worst_rounds(self) -> int:
        """How many rounds the most-selected node took part in."""
        return max((self.rounds_of(n) for n in self.nodes), default=0)

    def rounds_of(self, node: str) -> int:
        s = self.nodes.get(node)
        if s is None:
            return 0
        z = self.z / 2 if self.replace_one else self.z
        gauss = round(s["rho"] * z * z) if z > 0 and math.isfinite(s["rho"]) else 0
        return gauss + sum(s["ddg"].values())

    def describe(self) -> str:
        what = (
            "the distributed discrete Gaussian's bound without subsampling"
            if self.ddg is not None
            else f"a Gaussian of multiplier z = {self.z:g}"
            + (" (z/2 for the replace-one sensitivity 2C of fixed-size sampling)" if self.replace_one else "")
        )
        return (
            f"against the server, which chose and saw each round's sample: no amplification by sampling; each "
            f"round a node took part in is {what} on the secure sum of at least t noise shares (the server's own "
            f"top-up not counted), composed over that node's rounds (PLD of the composed Gaussian); the worst "
            f"node's epsilon ({self.worst_rounds()} rounds)"
        )

    def state_dict(self) -> dict:
        return {"delta": self.delta, "kind": self.kind, "replace_one": self.replace_one, "nodes": self.nodes}

    def load_state_dict(self, state: dict) -> None:
        """Restore the nodes' charged rounds (a restart); ValueError for a state that is not one."""
        nodes = state.get("nodes") if isinstance(state, dict) else None
        if not isinstance(nodes, dict):
            raise ValueError("a server-view privacy ledger without its nodes")
        out = {}
        for node, s in nodes.items():
            rho = s.get("rho") if isinstance(s, dict) else None
            ddg = s.get("ddg", {}) if isinstance(s, dict) else None
            if (
                not isinstance(rho, (int, float))
                or not rho >= 0
                or not isinstance(ddg, dict)
                or not all(isinstance(v, int) and v >= 0 for v in ddg.values())
            ):
                raise ValueError(f"a server-view ledger entry out of range: {str(s)[:200]}")
            for key in ddg:
                params = json.loads(key)
                if not isinstance(params, dict) or any(k not in params for k in DDG_KEYS):
                    raise ValueError(f"a server-view ledger entry lacks discrete-Gaussian parameters: {key[:200]}")
            out[str(node)] = {"rho": float(rho), "ddg": dict(ddg)}
        self.nodes = out


@lru_cache(maxsize=4096)
def server_view_epsilon(rho: float, ddg: tuple[tuple[str, int], ...], delta: float, kind: str) -> float:
    """epsilon at ``delta`` of unsampled rounds: Gaussians whose 1/z^2 sum to ``rho`` (one Gaussian of
    multiplier rho^-1/2, priced exactly by its privacy profile whatever ``kind``) and
    discrete-Gaussian rounds (params json, count): with ``kind = "pld"`` each the continuous Gaussian of
    shoal.accounting_ddg.ddg_round_gaussian up to a pointwise factor e^{+-b} (so one Gaussian again, at
    delta e^-B, plus 2B), else in RDP, as their accountant."""
    if rho == math.inf:
        return math.inf
    if kind == "pld" and ddg:
        slack = 0.0
        for key, count in ddg:
            z, b = ddg_round_gaussian({**json.loads(key), "release_z": 0.0})
            rho += count * (z**-2 if z > 0 else math.inf)
            slack += count * b
        if not math.isfinite(rho + slack):
            return math.inf
        return gaussian_epsilon(rho**-0.5, delta * math.exp(-slack)) + 2 * slack
    if not ddg:  # one Gaussian: its exact privacy profile
        return gaussian_epsilon(rho**-0.5, delta) if rho > 0 else 0.0
    total = [a * rho / 2 for a in LEDGER_ORDERS]  # the Gaussian's RDP: a / (2 z^2) per round
    for key, count in ddg:
        curve = DdgRoundAccountant.rdp_curve({**json.loads(key), "q": 1.0, "release_z": 0.0})
        total = [t + count * r for t, r in zip(total, curve, strict=True)]
    return rdp_to_epsilon(LEDGER_ORDERS, total, delta)
