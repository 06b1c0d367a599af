"""Choosing where training runs: ``auto`` takes a GPU when there is one."""

from __future__ import annotations

import torch

from shoal.errors import ConfigError


def select_device(name: str = "auto") -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a torch.device that exists here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA GPU here; use auto or cpu")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} GPU(s) here")
        return dev
    raise ConfigError(f"device {name!r}: use auto, cpu, cuda or cuda:N")
