"""What a round runner and a client pool are, and what they may use of the simulation that runs them.

The in-process simulation (simulations/inprocess.py) chooses its round runner (plain, secure
aggregation's simulations/secure_rounds.py, virtual edges' simulations/hierarchy.py, the Ray
engine's partial sums) and its client pool; those modules see the simulation only through
:class:`RunnerHost`, so none of them imports the simulation that imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from shoal.config import Config
from shoal.params import ParamSpec
from shoal.rounds import Assignment, SyncRounds
from shoal.update import PartialSum, Update

if TYPE_CHECKING:
    from shoal.assembly import SimulationParts
    from shoal.client.state import State
    from shoal.privacy_state import PrivacyBudget

    from .client_data import ClientShards, PopulationShards
    from .wire_step import WireStep


# A step between a client's training and the aggregator (an attack, local DP noise,
# compression...). Each feature adds its own in ``InProcessSimulation._client_steps``.
ClientStep = Callable[[Assignment, Update], Update]


class RoundRunner(Protocol):
    """How a round's selected clients turn into the updates the aggregator receives."""

    def updates(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        """Aggregator-ready updates; raise SecAggAborted to abort the round (model unchanged)."""
        ...


class ClientPool(Protocol):
    """Who trains the selected clients: this process (LocalClients) or workers elsewhere."""

    def train(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]: ...


class SummingRunner(Protocol):
    """A round runner whose clients' updates arrive already summed (the Ray engine's workers, when
    the pipeline is a plain weighted mean): ``run_round`` submits each part with SyncRounds.submit_sum."""

    def partial_sums(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[PartialSum]: ...


class RunnerHost(Protocol):
    """What a round runner uses of the simulation it runs in (InProcessSimulation)."""

    @property
    def client_steps(self) -> list[ClientStep]:
        """Attack, DP noise share, wire: fixed when the simulation starts (read, never re-wired)."""
        ...

    @property
    def parts(self) -> SimulationParts: ...

    @property
    def cfg(self) -> Config: ...

    @property
    def client_ids(self) -> list[str]: ...

    @property
    def spec(self) -> ParamSpec: ...

    @property
    def rounds(self) -> SyncRounds: ...

    @property
    def wire(self) -> WireStep: ...

    @property
    def privacy(self) -> PrivacyBudget | None: ...

    @property
    def shards(self) -> ClientShards | PopulationShards: ...

    def train_clients(
        self, tasks: list[Assignment], global_params: torch.Tensor
    ) -> Iterator[tuple[Assignment, Update]]: ...

    def submit_clients(
        self, tasks: list[Assignment], global_params: torch.Tensor
    ) -> Callable[[], list[tuple[Assignment, Update]]]: ...

    def apply_client_steps(self, task: Assignment, update: Update) -> Update | None: ...

    def held_to_server(self, client_id: str) -> State: ...
