"""Ray workers that would share one GPU of this machine give way to the in-process engine: the
decision as a pure function of the config and the machine's GPUs and CPUs (no GPU, no Ray needed)."""

from __future__ import annotations

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.simulations.ray_gpu_sharing import engine_for_run, sharing_reason


def ray(*extra: str):
    return load_config(None, ["simulation.engine='ray'", *extra])


HALF = "simulation.ray_gpus_per_worker=0.5"


def test_workers_sharing_one_local_gpu_run_in_process_unless_forced():
    # the suite's ray_gpu section: two workers of half a GPU on a one-GPU machine
    why = sharing_reason(ray(HALF, "simulation.ray_num_cpus=4"), gpus=1, cpus=16)
    assert why is not None and "put 2 workers on one GPU" in why and "ray_share_gpu = true" in why
    assert "put 4 workers" in sharing_reason(ray("simulation.ray_gpus_per_worker=0.25"), gpus=1, cpus=16)
    # Ray packs one GPU with half shares before the next: two GPUs, two workers, still one GPU shared
    assert "put 2 workers" in sharing_reason(ray(HALF, "simulation.ray_workers=2"), gpus=2, cpus=16)
    # no share reserved but device cuda: every worker takes the same device
    cuda = ray("simulation.device='cuda'", "simulation.ray_workers=3")
    assert "put 3 workers" in sharing_reason(cuda, gpus=1, cpus=16)
    # what keeps Ray as asked
    assert sharing_reason(ray(HALF, "simulation.ray_share_gpu=true"), gpus=1, cpus=16) is None  # forced
    assert sharing_reason(ray(HALF), gpus=0, cpus=16) is None  # no GPU here: Ray on the CPUs (a CPU test cluster)
    assert sharing_reason(ray(), gpus=1, cpus=16) is None  # device auto without a GPU share: workers on the CPU
    assert sharing_reason(ray("simulation.device='cpu'", HALF), gpus=1, cpus=16) is None
    assert sharing_reason(ray(HALF, "simulation.ray_address='10.0.0.1:6379'"), gpus=1, cpus=16) is None  # a cluster
    assert sharing_reason(ray(HALF, "simulation.ray_workers=1"), gpus=1, cpus=16) is None  # one worker, one GPU
    assert sharing_reason(ray("simulation.ray_gpus_per_worker=1"), gpus=2, cpus=16) is None  # a GPU each
    assert sharing_reason(ray(HALF, "simulation.mode='gossip'"), gpus=1, cpus=16) is None  # peers one by one anyway
    assert sharing_reason(ray(HALF, "simulation.batch_clients=1"), gpus=1, cpus=16) is None  # no batching here
    assert sharing_reason(ray(HALF, "simulation.ray_workers=8"), gpus=1, cpus=16) is None  # Ray's own ConfigError
    assert sharing_reason(load_config(None, [HALF]), gpus=1, cpus=16) is None  # the in-process engine already
    with pytest.raises(ConfigError, match="ray_share_gpu"):
        load_config(None, ["simulation.ray_share_gpu=true"])  # only the Ray engine has workers to share a GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine this config gives way to in-process")
def test_a_machine_without_a_gpu_runs_ray_as_asked():
    cfg = ray(HALF)
    assert engine_for_run(cfg) is cfg
