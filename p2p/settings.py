"""Which gossip settings a run can serve, checked from the config alone.

Kept apart from p2p/robust.py (the robust mixing itself) so that the config's own checks
(shoal/config/rules.py) can call it without importing the aggregation code: this module imports
nothing of shoal but its errors. ``cfg`` is a :class:`shoal.config.Config`.
"""

from __future__ import annotations

from typing import Any

from shoal.errors import ConfigError


def robust_mixing(cfg: Any) -> bool:
    """True when D-PSGD must mix node by node through a robust rule (not ``W @ X``)."""
    return cfg.robust.rule != "mean" or cfg.robust.norm_bound > 0


def check_gossip_settings(cfg: Any) -> None:
    """Refuse ``[robust]`` / ``[compression]`` settings that gossip cannot honour, by name."""
    g = cfg.gossip
    if cfg.compression.encoding == "topk":
        raise ConfigError(
            "compression.encoding = 'topk' with gossip: top-k of a whole model drops most of it, and error "
            "feedback needs a reference model both peers share, which push-pull with random partners does not "
            "keep; use 'q8' (8-bit model) and/or compression.zstd = true"
        )
    if g.algorithm == "group_average":
        if cfg.robust.rule != "mean" or cfg.robust.norm_bound > 0:
            raise ConfigError(
                "[robust] with gossip.algorithm = 'group_average': a group's reducers average exactly what "
                "arrived, with no robust rule yet; set robust.rule = 'mean' and robust.norm_bound = 0, or use "
                "gossip.algorithm = 'dpsgd' (robust mixing) or 'gossip' (bounded merges)"
            )
        if cfg.compression.encoding != "dense" or cfg.compression.zstd:
            raise ConfigError(
                "[compression] with gossip.algorithm = 'group_average': model slices travel as dense float32; "
                "set compression.encoding = 'dense' and compression.zstd = false"
            )
    if g.algorithm == "gossip" and cfg.robust.rule != "mean":
        raise ConfigError(
            f"robust.rule = {cfg.robust.rule!r} with gossip.algorithm = 'gossip': a push-pull merge sees one "
            "model at a time, so there is nothing to take a median of; use robust.norm_bound > 0 (clipped or "
            "rejecting merge) or gossip.algorithm = 'dpsgd', which mixes a whole neighbourhood through the rule"
        )
