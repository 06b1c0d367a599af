"""Atomic checkpoints of the server after each new global version.

One safetensors file per version, ``ckpt-<version>.safetensors``: the model (tensor
``params``), the strategy's tensors (``opt.*``) and the rest of the state as JSON in
the metadata (round, version, optimizer scalars; client selection and task seeds are
derived from (seed, round), so no RNG state beyond those two is needed). It is written
to a temporary file, fsynced, renamed over the final name and the folder fsynced, so a
crash leaves either the old or the new checkpoint, never a torn one.

A disk can still damage a file later (a bad sector, a copy cut short, an operator's
mistake), so each checkpoint carries the SHA-256 of its content (every tensor's name, dtype,
shape and bytes, and the state JSON) in its metadata. :func:`newest_intact` reads the newest
checkpoint whose file parses and whose checksum matches, naming each damaged one it passes
over in one line: a truncated, empty, random or bit-flipped latest checkpoint costs the
versions since the one before it, not the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from shoal.errors import ConfigError, ShoalError
from shoal.tensor_file import write_safetensors

log = logging.getLogger(__name__)

FORMAT = "shoal-ckpt/1"
_NAME = re.compile(r"^ckpt-(\d{8})\.safetensors$")


class CorruptCheckpoint(ShoalError):
    """A checkpoint file that cannot be read back as it was written."""

    code = "corrupt_checkpoint"


def content_digest(tensors: dict[str, torch.Tensor], state_json: str) -> str:
    """SHA-256 over every tensor (name, dtype, shape, bytes, in name order) and the state JSON."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy
    h.update(state_json.encode())
    return h.hexdigest()


def save_checkpoint(
    directory: str | Path, version: int, tensors: dict[str, torch.Tensor], state: dict[str, Any], keep: int = 3
) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt-{version:08d}.safetensors"
    tmp = d / f".{final.name}.tmp"
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    state_json = json.dumps(state)
    metadata = {"format": FORMAT, "state": state_json, "sha256": content_digest(cpu, state_json)}
    with open(tmp, "wb") as f:
        write_safetensors(f, cpu, metadata)  # from the live tensors: no serialised copy of the model
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in sorted(p for p in d.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink()
    return final


def write_durably(path: str | Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, also after a crash: a temporary file,
    fsynced, renamed over ``path``, the folder fsynced (the privacy ledger)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(directory: str | Path) -> Path | None:
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and state of one checkpoint; CorruptCheckpoint (saying what is wrong) if the
    file does not parse or its content does not match its checksum."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CorruptCheckpoint(f"not a whole safetensors file ({type(e).__name__}: {str(e)[:120]})") from None
    if meta.get("format") != FORMAT:
        raise CorruptCheckpoint(f"format {str(meta.get('format'))[:40]!r}, expected {FORMAT!r}")
    state_json = meta.get("state")
    if not isinstance(state_json, str):
        raise CorruptCheckpoint("no state in its metadata")
    expected = meta.get("sha256")
    if expected is None:  # written before checkpoints carried checksums: nothing to check against
        log.info("checkpoint %s has no checksum (written by an older shoal); not verified", path)
    elif content_digest(tensors, state_json) != expected:
        raise CorruptCheckpoint("checksum mismatch: its content changed after it was written")
    try:
        state = json.loads(state_json)
    except ValueError:
        raise CorruptCheckpoint("its state is not JSON") from None
    if not isinstance(state, dict):
        raise CorruptCheckpoint("its state is not a JSON object")
    return tensors, state


def newest_intact(directory: str | Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that reads back whole (path, tensors, state); None if there is none.
    Damaged newer ones are named, with what is wrong, in one warning; ConfigError if all are."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted((p for p in d.iterdir() if _NAME.match(p.name)), reverse=True)
    damaged: list[str] = []
    for path in found:
        try:
            tensors, state = load_checkpoint(path)
        except CorruptCheckpoint as e:
            damaged.append(f"{path} ({e})")
            continue
        if damaged:
            log.warning("damaged checkpoint %s; resuming from %s, the newest intact one", "; ".join(damaged), path.name)
        return path, tensors, state
    if damaged:
        raise ConfigError(
            f"every checkpoint in {d} is damaged: {'; '.join(damaged)}. Restore one from a backup, "
            "or start at version 0 with --fresh (or another server.checkpoint_dir)"
        )
    return None
