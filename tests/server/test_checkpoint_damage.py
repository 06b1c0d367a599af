"""Damaged checkpoints: a truncated, empty, random or bit-flipped latest checkpoint is named in
one line and the server resumes from the newest intact one; all damaged is one clear error."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from shoal.errors import ConfigError
from shoal.server.checkpoint import CorruptCheckpoint, load_checkpoint, newest_intact, save_checkpoint
from shoal.server.store import open_service

from .live import small_config


def _write(d, versions=(1, 2, 3)):
    for v in versions:
        save_checkpoint(d, v, {"params": torch.full((64,), float(v)), "opt.m": torch.arange(8.0)}, {"version": v})
    return d / "ckpt-00000003.safetensors"


def _tensor_offset(path) -> int:
    """Where the tensor data of a safetensors file begins (after the 8-byte length and the header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


DAMAGE = {
    "truncated": lambda b, off: b[: len(b) // 2],
    "empty": lambda b, off: b"",
    "random": lambda b, off: os.urandom(len(b)),
    "flipped tensor byte": lambda b, off: b[: off + 40] + bytes([b[off + 40] ^ 0x01]) + b[off + 41 :],
    "flipped state byte": lambda b, off: b.replace(b'\\"version\\": 3', b'\\"version\\": 7'),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_named_and_the_one_before_is_used(tmp_path, caplog, kind):
    latest = _write(tmp_path)
    body = latest.read_bytes()
    damaged = DAMAGE[kind](body, _tensor_offset(latest))
    assert damaged != body
    latest.write_bytes(damaged)
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(latest)
    with caplog.at_level(logging.WARNING, logger="shoal.server.checkpoint"):
        path, tensors, state = newest_intact(tmp_path)
    assert path.name == "ckpt-00000002.safetensors" and state == {"version": 2}
    assert torch.equal(tensors["params"], torch.full((64,), 2.0))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "ckpt-00000003.safetensors" in lines[0] and "resuming from ckpt-00000002" in lines[0]


def test_every_checkpoint_damaged_is_one_error_with_the_fix(tmp_path):
    _write(tmp_path, (1, 2))
    for p in tmp_path.iterdir():
        p.write_bytes(b"")
    with pytest.raises(ConfigError, match="every checkpoint .* is damaged.*--fresh"):
        newest_intact(tmp_path)
    assert newest_intact(tmp_path / "none") is None


def test_the_server_resumes_from_the_newest_intact_checkpoint(tmp_path, caplog):
    """A real aggregator's checkpoints: the latest truncated, a restart resumes one version back."""
    cfg = small_config(tmp_path, clients_per_round=1, min_nodes=1, rounds=5)
    svc = open_service(cfg)
    saved = {}
    for v in (1, 2):  # two versions, each checkpointed by the store
        svc.rounds.global_params = svc.rounds.global_params + 0.5
        svc.rounds.version = svc.rounds.round = v
        svc.emit(svc._checkpoint())
        saved[v] = svc.rounds.global_params.clone()
    latest = tmp_path / "ck" / "ckpt-00000002.safetensors"
    latest.write_bytes(latest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        again = open_service(cfg)
    assert again.version == 1 and again.resumed_from.name == "ckpt-00000001.safetensors"
    assert torch.equal(again.rounds.global_params, saved[1])
    assert any("ckpt-00000002.safetensors" in r.getMessage() for r in caplog.records)
