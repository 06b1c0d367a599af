"""Simulated misbehaving clients: a fixed, seeded subset of clients that attack every
round they are selected.

Update attacks act after honest local training, as a ``client_step``
(simulations/inprocess.py): ``sign_flip`` sends ``-scale * delta`` (a gradient-ascent
attacker), ``scale`` sends ``scale * delta`` (model replacement by boosting, Bagdasaryan
et al. 2020), ``gaussian`` sends ``N(0, scale^2)`` noise, ``nan`` / ``inf`` send a
delta full of NaN / Inf, which wire validation must reject (the simulator counts it).
``label_flip`` is a data attack: the attackers train honestly on labels ``C - 1 - y``.
"""

from __future__ import annotations

import logging

import torch

from shoal.config import AttackConfig
from shoal.rounds import Assignment
from shoal.seeding import rng
from shoal.update import Update

log = logging.getLogger(__name__)

_ATTACK_STREAM = 0xA77AC  # seeds the attacker choice apart from client sampling


def choose_attackers(client_ids: list[str], fraction: float, seed: int) -> set[str]:
    """``round(fraction * n)`` clients from a seeded shuffle (the same for a given seed)."""
    n = round(fraction * len(client_ids))
    order = rng(seed, _ATTACK_STREAM).permutation(len(client_ids))
    return {client_ids[i] for i in order[:n]}


class UpdateAttack:
    """A client step that replaces an attacker's update; honest clients pass through."""

    def __init__(self, cfg: AttackConfig, attackers: set[str]):
        self.cfg = cfg
        self.attackers = attackers

    def __call__(self, task: Assignment, update: Update) -> Update:
        if task.client_id not in self.attackers:
            return update
        d = update.delta
        match self.cfg.kind:
            case "sign_flip":
                d = -self.cfg.scale * d
            case "scale":
                d = self.cfg.scale * d
            case "gaussian":
                gen = torch.Generator().manual_seed(task.seed)
                d = (torch.randn(d.shape, generator=gen) * self.cfg.scale).to(d.device)
            case "nan":
                d = torch.full_like(d, float("nan"))
            case "inf":
                d = torch.full_like(d, float("inf"))
        update.delta = d
        return update


def flip_labels(y: torch.Tensor, num_classes: int) -> None:
    """In place: label ``c`` becomes ``num_classes - 1 - c`` (Tolpegin et al. 2020)."""
    y.copy_(num_classes - 1 - y)


def label_count(sim) -> int:
    """The number of classes label flipping maps over: the task's ``num_classes``."""
    n = getattr(sim, "num_classes", None)
    if not n:
        from shoal.errors import ConfigError

        raise ConfigError(
            "attack.kind = 'label_flip' needs the task to say its num_classes (an attribute); "
            "add `num_classes = C` to the task, or choose another attack.kind"
        )
    return int(n)


def attack_steps(sim) -> list:
    """Set up ``sim.cfg.attack`` on an InProcessSimulation: flip the attackers' labels
    (data attacks) or return the client step (update attacks)."""
    cfg = sim.cfg.attack
    if cfg.kind == "none" or cfg.fraction == 0:
        return []
    attackers = choose_attackers(sim.client_ids, cfg.fraction, sim.cfg.simulation.seed)
    log.info("attack %s: %d of %d clients", cfg.kind, len(attackers), len(sim.client_ids))
    if cfg.kind == "label_flip":  # label c becomes C - 1 - c (Tolpegin et al. 2020)
        sim.shards.flip_labels(sorted(sim._index[cid] for cid in attackers), label_count(sim))
        return []
    return [UpdateAttack(cfg, attackers)]
