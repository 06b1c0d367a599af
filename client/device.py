"""Choosing where training runs: ``auto`` takes a GPU when there is one."""

from __future__ import annotations

import torch

from shoal.errors import ConfigError


def select_device(name: str = "auto") -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a torch.device that exists here.

    Choosing a GPU also turns on cuDNN's autotuner (``torch.backends.cudnn.benchmark``): shoal
    trains the same shapes over and over (a chunk of clients, a batch size), so timing the
    convolution algorithms once per shape pays; on an H100 it took the round of 1,000 batched
    MNIST CNN clients from 8.71 s to 5.94 s (docs/results.md, "GPU"). CUDA convolutions are not
    bit-reproducible with or without it; a task that needs that calls
    ``torch.use_deterministic_algorithms(True)``, which takes precedence.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA GPU here; use auto or cpu")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: only {torch.cuda.device_count()} GPU(s) here")
        torch.backends.cudnn.benchmark = True
        return dev
    raise ConfigError(f"device {name!r}: use auto, cpu, cuda or cuda:N")
