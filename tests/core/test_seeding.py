"""Seeds: derived seeds keep the full width of their parts; secret seeds (a keyed BLAKE2b of
OS bytes) make selections and task seeds nobody can recompute from the config."""

from __future__ import annotations

import os

import pytest
import torch

from shoal.rounds import SyncRounds
from shoal.seeding import derive_seed, rng, secret_rng, secret_seed


def test_derived_seeds_keep_every_bit_of_their_parts():
    secret = 1 << 100
    assert derive_seed(secret) != derive_seed(secret + (1 << 40))  # bits above 32 used to be masked away
    assert derive_seed(secret, 3) != derive_seed(3)
    assert derive_seed(5, 7) == derive_seed(5, 7) and 0 <= derive_seed(-1) < 1 << 63
    assert rng(secret).random() != rng(secret + (1 << 64)).random()


def test_secret_seeds_are_a_keyed_function_of_at_least_128_bits():
    key, other = os.urandom(32), os.urandom(32)
    assert secret_seed(key, 1, 2) == secret_seed(key, 1, 2) != secret_seed(other, 1, 2)
    assert secret_seed(key, 1, 2) != secret_seed(key, 2, 1) and secret_seed(key, 12) != secret_seed(key, 1, 2)
    assert 0 <= secret_seed(key, 1) < 1 << 63
    assert secret_rng(key, 4).random() == secret_rng(key, 4).random() != secret_rng(key, 5).random()
    with pytest.raises(ValueError, match="128 bits"):
        secret_seed(b"short", 1)


def _picks(rounds: SyncRounds, n: int = 12) -> list[tuple[tuple[str, int], ...]]:
    ids = [f"c{i}" for i in range(40)]
    out = []
    for _ in range(n):
        tasks = rounds.start_round(ids)
        out.append(tuple((t.client_id, t.seed) for t in tasks))
        rounds.open = False
    return out


def test_a_secret_decides_selection_and_task_seeds_whatever_the_config_seed():
    def make(seed: int, secret: bytes | None) -> SyncRounds:
        r = SyncRounds(None, torch.zeros(1), 10, sampling="poisson", seed=seed)
        r.strategy = type("S", (), {"begin": lambda self, p: None})()
        r.secret = secret
        return r

    key = os.urandom(32)
    assert _picks(make(0, key)) == _picks(make(99, key))  # the config seed plays no part
    assert _picks(make(0, key)) != _picks(make(0, os.urandom(32)))
    assert _picks(make(0, None)) == _picks(make(0, None)) != _picks(make(0, key))  # reproducible without one
