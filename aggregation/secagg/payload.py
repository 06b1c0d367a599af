"""What a client masks for secure aggregation, per algorithm, and what the server gets back.

Secure aggregation only ever reveals a sum, so an algorithm's server step can run under it
exactly when everything it needs is a sum. The masked vector of every client starts with
``[w_k clip(x_k), w_k]`` (aggregation/secagg/encoding.py: the weighted sum and the weights'
sum give the mean); what ``x_k`` is and what follows depend on the algorithm:

- FedAvg, FedProx, FedDyn, Ditto, FedPer, FedRep: ``x_k = Delta_k``. FedDyn's server step needs
  only the mean and the number of clients in it, which the protocol reports.
- FedNova (Wang et al. 2020): ``x_k = Delta_k / a_k``, so the mean is FedNova's normalised one;
  ``a_k`` (the client's local-step weight) travels in the clear beside the keys, like the example
  count: it is a function of that count and the run's public settings (epochs, batch size,
  momentum), so it reveals nothing the count does not.
- SCAFFOLD (Karimireddy et al. 2020): the control-variate delta ``Delta c_k`` is a second release
  of the client's data, so it is masked too: the vector is ``[w_k clip(Delta_k), w_k,
  clip(Delta c_k)]`` and the server learns only ``sum_k Delta c_k``, all that ``c <- c + (1/N)
  sum_k Delta c_k`` needs. Entries of ``Delta c_k`` are clipped to the same
  ``secure_aggregation.clip`` as the update's; a client logs how many were.

:meth:`SecurePayload.updates` turns the unmasked sums back into one :class:`Update` per included
client, each carrying the round's aggregate (the mean, and SCAFFOLD's ``sum Delta c / count``),
so that the strategy's own weighting and server step (aggregation/strategy.py, scaffold.py,
fednova.py, feddyn.py) reproduce the algorithm's result; the simulator
(simulations/secure_rounds.py), the node (client/secure_node.py) and the server
(server/secure_round.py) all use this one layout. Sans-I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from shoal.algorithms import algorithm
from shoal.update import Update

from .encoding import FixedPoint, encode_weighted, weighted_mean

log = logging.getLogger(__name__)

SCAFFOLD_DC = "scaffold/dc"
FEDNOVA_A = "fednova_a"


@dataclass
class SecureSums:
    """The decoded result of one secure round: the weighted mean of the ``x_k``, the summed weight,
    how many clients are in it, and the unweighted sums of what else the algorithm masks."""

    mean: np.ndarray
    total_weight: float
    count: int
    aux: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class SecurePayload:
    """The masked-vector layout of ``algorithm`` for a model of ``numel`` parameters (module doc)."""

    algorithm: str
    numel: int

    @property
    def masks_control(self) -> bool:
        """Each client masks its control-variate delta beside its update (the registry's declaration)."""
        return algorithm(self.algorithm).secure_payload == "control_delta"

    @property
    def normalised(self) -> bool:
        """Each client masks ``Delta_i / a_i`` and sends ``a_i`` in the clear (FedNova's normalised mean)."""
        return algorithm(self.algorithm).secure_payload == "normalised"

    @property
    def vector_size(self) -> int:
        """Entries each client masks: the update, its weight, and SCAFFOLD's ``Delta c``."""
        return self.numel + 1 + (self.numel if self.masks_control else 0)

    def clear_meta(self, update: Update) -> dict[str, float]:
        """What beside the example count travels in the clear: FedNova's ``a_k``."""
        if not self.normalised:
            return {}
        return {FEDNOVA_A: step_weight(update.metrics.get(FEDNOVA_A), update.sender)}

    def encode(
        self, update: Update, weight: float, values: FixedPoint, weights: FixedPoint, rng: np.random.Generator
    ) -> np.ndarray:
        """The fixed-point vector a client masks (uint32, :attr:`vector_size` entries)."""
        delta = update.delta.detach().cpu().numpy().astype(np.float64)
        if delta.size != self.numel:
            raise ValueError(f"the update has {delta.size} entries, the model {self.numel}")
        if self.normalised:
            delta = delta / step_weight(update.metrics.get(FEDNOVA_A), update.sender)
        vec = encode_weighted(delta, weight, values, weights, rng)
        if not self.masks_control:
            return vec
        dc = update.to_server.get(SCAFFOLD_DC)
        if dc is None or dc.numel() != self.numel:
            raise ValueError("SCAFFOLD's update carries no control-variate delta of the model's size")
        dc_np = dc.detach().cpu().numpy().astype(np.float64)
        if not np.isfinite(dc_np).all():
            raise ValueError("SCAFFOLD's control-variate delta has NaN/Inf entries; refusing to encode it")
        clipped = int((np.abs(dc_np) > values.clip).sum())
        if clipped:
            log.warning(
                "%d of %d entries of SCAFFOLD's control-variate delta exceed secure_aggregation.clip = %g and "
                "are clipped: the server's c moves less than the algorithm says (raise secure_aggregation.clip)",
                clipped,
                self.numel,
                values.clip,
            )
        return np.concatenate([vec, values.encode(np.clip(dc_np, -values.clip, values.clip), rng)])

    def decode(self, total: np.ndarray, count: int, values: FixedPoint, weights: FixedPoint) -> SecureSums:
        """The unmasked integer sum of ``count`` clients' vectors, decoded (SecAggAborted when
        their summed weight is not positive)."""
        if total.size != self.vector_size:
            raise ValueError(f"the sum has {total.size} entries, the layout {self.vector_size}")
        head = self.numel + 1
        mean, wsum = weighted_mean(total[:head], count, values, weights)
        aux = {SCAFFOLD_DC: values.decode_sum(total[head:], count)} if self.masks_control else {}
        return SecureSums(mean, wsum, count, aux)

    def updates(
        self, sums: SecureSums, members: Mapping[str, tuple[int, dict[str, float]]], version: int
    ) -> list[Update]:
        """One update per included client, ``members[name] = (num_examples, clear metrics)``, each
        carrying the round's aggregate so the strategy's server step gives the algorithm's result:
        the mean itself (FedNova: ``mean * a_k``, which its strategy divides by ``a_k`` again and
        rescales by the round's effective step count), and for SCAFFOLD ``sum Delta c / count`` each,
        so the server's ``c`` moves by the sum."""
        mean = torch.from_numpy(sums.mean).to(torch.float32)
        extra = {}
        if self.masks_control:
            extra = {SCAFFOLD_DC: torch.from_numpy(sums.aux[SCAFFOLD_DC] / max(sums.count, 1)).to(torch.float32)}
        out = []
        for name, (n, metrics) in members.items():
            delta = mean
            if self.normalised:
                delta = mean * step_weight(metrics.get(FEDNOVA_A), name)
            out.append(Update(delta, n, version, name, dict(metrics), dict(extra)))
        return out


def step_weight(a: object, who: str = "") -> float:
    """FedNova's ``a_k``, checked: a finite number >= 1 (ValueError otherwise)."""
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not (math.isfinite(a) and a >= 1.0):
        raise ValueError(
            f"FedNova's update from {who or 'a client'} needs metrics.fednova_a >= 1 (its local steps' weight), "
            f"got {a!r}"
        )
    return float(a)
