"""When ``simulation.engine = "ray"`` would put several workers on one GPU of this machine, the
in-process engine runs instead (unless ``simulation.ray_share_gpu = true``).

Why: Ray workers sharing a GPU are separate processes, each with its own CUDA context, model
replica and copy of the clients' data; without NVIDIA MPS the GPU time-slices between them. The
in-process engine trains the whole round's clients on that GPU in one batched trainer (each Ray
worker batches only its part), which is the efficient use of one GPU. Measured on an H200
(docs/ray.md, "One GPU"): two workers x 0.5 GPU were 1.21x slower per round than in-process.

The decision (:func:`sharing_reason`) is a pure function of the config and of the GPUs and CPUs
this machine has; :func:`engine_for_run` applies it where a run starts. It applies only to a Ray
runtime that shoal starts here (no ``simulation.ray_address``, Ray not already initialised by the
caller), to sync and async rounds (gossip trains its peers one at a time on either engine), and
to a batching in-process engine (``simulation.batch_clients`` not 1). A machine without a GPU
always runs Ray as asked.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys

from shoal.config import Config
from shoal.errors import ConfigError

log = logging.getLogger(__name__)


def workers_per_gpu(cfg: Config, workers: int, gpus: int) -> int:
    """The most Ray workers that train on one GPU (0: the workers train on the CPU).

    ``ray_gpus_per_worker = 0`` with ``device = "cuda..."``: Ray reserves no GPU, so every worker
    takes the same device. A share of at most one half: Ray packs one GPU with shares before it
    moves on to the next, ``floor(1 / share)`` workers to a GPU. A larger share: one worker a GPU."""
    sim = cfg.simulation
    share = sim.ray_gpus_per_worker
    on_gpu = sim.device.startswith("cuda") or (sim.device == "auto" and share > 0)
    if gpus < 1 or not on_gpu:
        return 0
    if share == 0:
        return workers
    return min(workers, max(1, math.floor(1 / share + 1e-9)))


def sharing_reason(cfg: Config, gpus: int, cpus: int) -> str | None:
    """Why this run should take the in-process engine instead of Ray workers sharing a GPU, or None
    to run as configured. ``gpus``, ``cpus``: what this machine has (a local Ray runtime sees them)."""
    from .ray_engine import worker_count

    sim = cfg.simulation
    if sim.engine != "ray" or sim.ray_share_gpu or sim.ray_address:
        return None
    if sim.mode == "gossip" or sim.batch_clients == 1:
        return None
    try:
        workers = worker_count(cfg, sim.ray_num_cpus or cpus, gpus, nodes=1)
    except ConfigError:
        return None  # the Ray engine says what the machine cannot hold
    shared = workers_per_gpu(cfg, workers, gpus)
    if shared < 2:
        return None
    return (
        f"simulation.engine = 'ray' would put {shared} workers on one GPU of this machine "
        f"(ray_gpus_per_worker = {sim.ray_gpus_per_worker:g}, device = {sim.device!r}): they would time-slice it, "
        "each with its own CUDA context and copy of the data, while the in-process engine trains the whole "
        "round's clients on it in one batched trainer, so the in-process engine runs (docs/ray.md, 'One GPU'); "
        "set simulation.ray_share_gpu = true to run the Ray workers anyway"
    )


def engine_for_run(cfg: Config) -> Config:
    """``cfg``, or a copy with ``simulation.engine = "inprocess"`` when :func:`sharing_reason` says so
    for this machine (said in a warning)."""
    if cfg.simulation.engine != "ray":
        return cfg
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return cfg  # the caller's own Ray runtime: its resources are what it chose
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = sharing_reason(cfg, gpus, os.cpu_count() or 1)
    if why is None:
        return cfg
    log.warning("%s", why)
    out = copy.deepcopy(cfg)
    out.simulation.engine = "inprocess"
    return out
