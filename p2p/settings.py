"""Which gossip settings a run can serve, checked from the config alone.

The settings a run may ask for are checked by the config itself
(``shoal.config.rules.check_gossip_settings``); this is what the peer derives from them.
``cfg`` is a :class:`shoal.config.Config`.
"""

from __future__ import annotations

from typing import Any


def robust_mixing(cfg: Any) -> bool:
    """True when D-PSGD must mix node by node through a robust rule (not ``W @ X``)."""
    return cfg.robust.rule != "mean" or cfg.robust.norm_bound > 0
