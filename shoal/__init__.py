"""shoal: federated and decentralized (gossip) training for PyTorch."""

import os as _os

# Nothing phones home: Flower's telemetry and update checks are off for every user of
# shoal, set before anything imports flwr.
_os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
_os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

__version__ = "0.1.0"

from .task import LocalData, Population, SimulationData, Task, TaskError, load_task  # noqa: E402
from .task_data import Partitioned, partition_dataset  # noqa: E402

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
