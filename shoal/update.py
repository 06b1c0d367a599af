"""What a client sends back after local training."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Update:
    """A client's change to the global model it started from.

    ``delta`` is ``local_params - global_params`` as one flat float32 vector (see
    params.py). Staleness of an update is ``current_version - base_version``.
    """

    delta: torch.Tensor
    num_examples: int
    base_version: int = 0
    sender: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
