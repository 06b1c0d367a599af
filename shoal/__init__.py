"""shoal: federated and decentralized (gossip) training for PyTorch."""

import os as _os

# Nothing phones home: Flower's telemetry and update checks are off for every user of
# shoal, set before anything imports flwr.
_os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
_os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

__version__ = "0.1.0"

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from .task import LocalData, Population, SimulationData, Task, TaskError, load_task
    from .task_data import Partitioned, partition_dataset

# The task API is imported on first use (PEP 562), not with the package: `shoal pki`, `shoal run`
# and the other commands that need no model start without importing torch.
_LAZY = {
    "LocalData": "task",
    "Population": "task",
    "SimulationData": "task",
    "Task": "task",
    "TaskError": "task",
    "load_task": "task",
    "Partitioned": "task_data",
    "partition_dataset": "task_data",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "LocalData",
    "Partitioned",
    "Population",
    "SimulationData",
    "Task",
    "TaskError",
    "load_task",
    "partition_dataset",
]
