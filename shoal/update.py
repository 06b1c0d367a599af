"""What a client sends back after local training."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Update:
    """A client's change to the global model it started from.

    ``delta`` is ``local_params - global_params`` as one flat float32 vector (see
    params.py). Staleness of an update is ``current_version - base_version``.
    ``to_server``: what the algorithm's server step needs beside the update (SCAFFOLD's
    control-variate delta ``scaffold/dc``, a flat float32 vector like ``delta``).
    """

    delta: torch.Tensor
    num_examples: int
    base_version: int = 0
    sender: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    to_server: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PartialSum:
    """Several clients' updates of one round, already summed where they were trained (the Ray
    engine's workers): ``weighted_sum = sum_k w_k delta_k`` in float64 with ``w_k`` as the
    strategy's ``weighting`` gives it (n_k for ``examples``, 1 for ``uniform``).

    Only a plain weighted mean may take one (SyncRounds.submit_sum): nothing that looks at a
    single update (clipping, a robust rule, masking, a per-client step) can run on a sum.
    ``loss_sum`` is ``sum_k train_loss_k n_k`` so the round's train loss stays example-weighted.
    """

    weighted_sum: torch.Tensor
    total_weight: float
    weighting: str
    senders: list[str]
    num_examples: int
    loss_sum: float
    base_version: int = 0
