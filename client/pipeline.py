"""One client pipeline: an assignment in, the payload that leaves the client out, its outcome back.

Every place that trains a client runs these steps through :class:`ClientPipeline`: the in-process
simulator (simulations/inprocess.py), the Ray engine's workers and driver
(simulations/ray_worker.py, ray_engine.py), the Flower ClientApp (flower/apps.py), the deployed
node (client/node.py) and the gossip peer's local step (:meth:`ClientPipeline.local_step`):

1. **train** (:meth:`~ClientPipeline.train`): the algorithm's client program (client/algorithms.py)
   from the global model, with the client's state and the server's broadcast; many clients at
   once on the batched trainer when the model allows, else one by one. torch's global RNG (what
   dropout draws from) is seeded from the assignment's seed for each client, so a client's update
   is the same on whichever engine, worker or process trains it;
2. **client state** (:meth:`~ClientPipeline.keep`): the new state replaces the client's in its
   store (client/state.py), or, for an algorithm whose state mirrors the server's (SCAFFOLD), is
   held until the round settles;
3. **DP, compression, secure payload, upload**: what the engine or node does with the update:
   the simulator's client steps (attacks, distributed-DP noise shares, the wire step's compression),
   the node's privacy side (clip and noise share, DP-SGD's release) and its encoder
   (:meth:`~ClientPipeline.encode`: top-k / float16 with the error-feedback residual), or secure
   aggregation's masked payload;
4. **settle** (:meth:`~ClientPipeline.settle`, :meth:`~ClientPipeline.feedback`): what came back: held
   state kept for the clients whose update the server took, dropped for the others; top-k's
   error feedback told whether each upload was accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shoal.aggregation.compression import Compressor, Encoded
from shoal.rounds import Assignment
from shoal.task import ClientData
from shoal.update import Update

from .algorithms import ClientProgram, ClientResult, train_batched
from .state import ClientState, MemoryClientState, State
from .training import seeded_rng

if TYPE_CHECKING:
    from .batched import BatchedTrainer
    from .training import LocalTrainer

# (x, y, starts, sizes) of a cohort for the batched trainer (simulations/client_data.py's gather)
Cohort = tuple[torch.Tensor, torch.Tensor, list[int], list[int]]


class StepTrainer(Protocol):
    """What a local step needs of a trainer (a LocalTrainer, or a peer's)."""

    device: torch.device

    def fit(self, global_flat: torch.Tensor, data: ClientData, seed: int) -> Update: ...


def local_step(trainer: StepTrainer, start: torch.Tensor, data: ClientData, seed: int) -> Update:
    """A gossip peer's local training from its own model ``start`` (no algorithm state, no
    broadcast): plain local SGD (or DP-SGD) seeded like every client's, dropout included; the
    trained model is ``trainer.flat``. The entry point of a peer that holds a trainer only."""
    with seeded_rng(seed, trainer.device):
        return trainer.fit(start, data, seed)


class ClientPipeline:
    """The client's steps around one client program (``program``: the trainer and the algorithm's
    local step), its state store (``states``, default in memory) and, where this process encodes
    uploads itself (a node), the upload's ``compressor``. ``batched``: the batched trainer, when the
    model and task allow training many clients at once."""

    def __init__(
        self,
        program: ClientProgram,
        states: ClientState | None = None,
        batched: BatchedTrainer | None = None,
        compressor: Compressor | None = None,
    ):
        self.program = program
        self.trainer: LocalTrainer = program.trainer
        self.states: ClientState = states if states is not None else MemoryClientState()
        self.batched = batched
        self.compressor = compressor
        self._held: dict[str, ClientResult] = {}  # settling programs: kept once the server took the update

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    # --- 1. train -------------------------------------------------------------------------------

    def state_of(self, client_id: str) -> State:
        """What ``client_id`` kept from its last round (empty when the algorithm keeps nothing)."""
        return self.states.get(client_id) if self.program.keeps_state else {}

    def train_one(
        self,
        data: ClientData,
        task: Assignment,
        global_flat: torch.Tensor,
        state: State,
        broadcast: State,
        on_disk: bool = False,
    ) -> ClientResult:
        """One client's local step with its RNG seeded from ``task.seed`` (``on_disk``: the global
        model is a client/disk_model.py stand-in, trained without the program's state handling)."""
        with seeded_rng(task.seed, self.device):
            if on_disk:
                return self.program.local(data, task, global_flat, state, broadcast)
            return self.program.fit(data, task, global_flat, state, broadcast)

    def train(
        self,
        tasks: list[Assignment],
        global_flat: torch.Tensor,
        broadcast: State,
        data: Callable[[int], ClientData],
        cohort: Callable[[], Cohort] | None = None,
        states: list[State] | None = None,
    ) -> Iterator[tuple[int, ClientResult]]:
        """Each task's result (index into ``tasks``, result), nothing kept: on the batched trainer
        when there is one and ``cohort`` gives the tasks' data at once (in the batched trainer's
        order), else one by one with ``data(j)`` (in ``tasks`` order). ``states``: each task's
        client state (default: from the store)."""
        states = [self.state_of(t.client_id) for t in tasks] if states is None else states
        if self.batched is not None and cohort is not None:
            yield from train_batched(self.program, self.batched, global_flat, cohort(), tasks, states, broadcast)
            return
        for j, task in enumerate(tasks):
            yield j, self.train_one(data(j), task, global_flat, states[j], broadcast)

    def run(
        self,
        tasks: list[Assignment],
        global_flat: torch.Tensor,
        broadcast: State,
        data: Callable[[int], ClientData],
        cohort: Callable[[], Cohort] | None = None,
    ) -> Iterator[tuple[Assignment, Update]]:
        """Train ``tasks`` (:meth:`train`) and keep each client's state (:meth:`keep`): the updates
        that go on to the DP, compression and secure-aggregation steps."""
        for j, result in self.train(tasks, global_flat, broadcast, data, cohort):
            yield tasks[j], self.keep(tasks[j].client_id, result)

    def local_step(self, start: torch.Tensor, data: ClientData, seed: int) -> Update:
        """A gossip peer's local training (:func:`local_step` with this pipeline's trainer)."""
        return local_step(self.trainer, start, data, seed)

    # --- 2. client state --------------------------------------------------------------------------

    def keep(self, client_id: str, result: ClientResult) -> Update:
        """Store the client's new state (or hold it until the round settles); its update."""
        if self.program.settles:
            self._held[client_id] = result
        elif self.program.keeps_state:
            self.states.put(client_id, result.state)
        return result.update

    def held_to_server(self, client_id: str) -> State:
        """The live ``to_server`` of ``client_id``'s held result (empty when none is held): secure
        aggregation masks it and puts the round's unmasked share of the sum in its place."""
        result = self._held.get(client_id)
        return result.to_server if result is not None else {}

    # --- 3. the upload's encoding ---------------------------------------------------------------

    def encode(self, update: Update, client_id: str, seed: int, tag: Any) -> Encoded:
        """The upload's payload by ``[compression]`` (top-k adds the client's error-feedback residual
        first); ``tag`` names this upload in :meth:`feedback`."""
        if self.compressor is None:
            raise ValueError("this pipeline encodes no uploads: it was built without a compressor")
        return self.compressor.encode(update.delta, client_id, seed, tag)

    # --- 4. settle --------------------------------------------------------------------------------

    def feedback(self, client_id: str, tag: Any, accepted: bool) -> None:
        """Top-k error feedback: what the upload ``tag`` carried goes back into the residual unless
        the server took it."""
        if self.compressor is not None:
            (self.compressor.accepted if accepted else self.compressor.not_accepted)(client_id, tag)

    def settle(self, accepted: set[str] | None) -> list[State]:
        """Close the round for the algorithm: the accepted clients' held state is kept, the others'
        dropped (``None``: none accepted). Returns the kept clients' ``to_server`` (what the
        server's step adds: SCAFFOLD's Delta c_i)."""
        held, self._held = self._held, {}
        out = []
        for cid, result in held.items():
            if accepted is not None and cid in accepted:
                self.states.put(cid, result.state)
                out.append(result.to_server)
        return out

    def settle_one(self, client_id: str, result: ClientResult, accepted: bool) -> None:
        """A client that settles its own round (a node): its held ``result``'s state is kept when
        the server took the update."""
        self._held.pop(client_id, None)
        if accepted and self.program.keeps_state:
            self.states.put(client_id, result.state)
