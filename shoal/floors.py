"""Floors a run's config cannot lower: the federation's (``[federation]`` of the server's config)
and each node's (``[limits]`` of its node config, client/node_config.py).

One check serves both sides, so the server refuses at submission what a node would refuse at the
offer, with the same reason. A floor is an operator's: the submitter's config is compared with it
and never changes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shoal.config import Config
from shoal.config.sections import MIN_SECURE_INPUTS


class Floors(Protocol):
    """What an operator allows a run (max_parameters and max_target_epsilon 0: no limit of that kind)."""

    @property
    def max_epochs(self) -> int: ...
    @property
    def max_rounds(self) -> int: ...
    @property
    def privacy_modes(self) -> Sequence[str]: ...
    @property
    def min_secure_group(self) -> int: ...
    @property
    def require_secure_aggregation(self) -> bool: ...
    @property
    def min_noise_multiplier(self) -> float: ...
    @property
    def max_target_epsilon(self) -> float: ...
    @property
    def max_parameters(self) -> int: ...
    @property
    def min_abort_bound(self) -> float: ...


def below_floor(floors: Floors, cfg: Config, whose: str, parameters: int | None = None) -> str | None:
    """Why ``cfg`` (a validated run config) is below ``floors`` (None: it is not). ``whose``
    names the operator in the reason ("node n3's", "the federation's"); ``parameters``: the
    model's size once known."""
    f, train, s, p, sa = floors, cfg.train, cfg.server, cfg.privacy, cfg.secure_aggregation
    if train.epochs > f.max_epochs:
        return f"train.epochs = {train.epochs} is over {whose} limit of {f.max_epochs}"
    if s.rounds > f.max_rounds:
        return f"server.rounds = {s.rounds} is over {whose} limit of {f.max_rounds}"
    if p.mode not in f.privacy_modes:
        return f"privacy.mode = {p.mode!r} is not one {whose} operator allows ({', '.join(f.privacy_modes)})"
    if f.require_secure_aggregation and not sa.enabled:
        return f"{whose} operator takes part only in securely aggregated runs (secure_aggregation.enabled = true)"
    if sa.enabled:
        least = max(MIN_SECURE_INPUTS, f.min_secure_group)
        if sa.min_inputs < least:
            return f"secure_aggregation.min_inputs = {sa.min_inputs} is below {whose} floor of {least}"
        if 0 < s.clients_per_round < least:  # 0 (all): a secure round opens with at least min_inputs nodes
            k = s.clients_per_round
            return f"server.clients_per_round = {k}: a secure sum of {k} nodes is below {whose} floor of {least}"
    if p.mode != "none":
        if p.noise_multiplier < f.min_noise_multiplier:
            z, z_min = p.noise_multiplier, f.min_noise_multiplier
            return f"privacy.noise_multiplier = {z:g} is below {whose} floor of {z_min:g}"
        if p.mode == "distributed" and sa.enabled and p.abort_bound < f.min_abort_bound:
            return (
                f"privacy.abort_bound = {p.abort_bound:g} is below {whose} floor of {f.min_abort_bound:g} (the "
                "operator's bound on a node deciding whether a secure round aborts)"
            )
        if f.max_target_epsilon and not 0 < p.target_epsilon <= f.max_target_epsilon:
            return (
                f"privacy.target_epsilon = {p.target_epsilon:g}: {whose} operator needs a target epsilon "
                f"of at most {f.max_target_epsilon:g} (set privacy.target_epsilon)"
            )
    if f.max_parameters and parameters is not None and parameters > f.max_parameters:
        return f"the model has {parameters} parameters, over {whose} limit of {f.max_parameters}"
    return None
