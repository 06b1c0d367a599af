"""Per-client state kept between a client's rounds: a ``ClientState`` store.

What a client remembers from one round to its next (FedBN's local BatchNorm statistics,
SCAFFOLD's control variate, FedDyn's gradient memory, Ditto's personal model, the personal
layers of FedPer / FedRep) is a flat ``{name: tensor}`` dict per client. The store holds these
dicts, keyed by client id:

- :class:`MemoryClientState`: in a Python dict (small simulations);
- :class:`DiskClientState`: one safetensors file per client in a folder, read when the client
  trains and written back after, so memory follows the round's cohort, not the population.

The simulator (in-process and the Ray engine's driver, which ships a client's state with its
training call and stores what comes back) is the only writer; nothing here knows about rounds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


class ClientState(Protocol):
    """Each client's ``{name: tensor}`` state; a client never seen has the empty dict."""

    def get(self, client_id: str) -> State: ...

    def put(self, client_id: str, state: State) -> None: ...

    def __contains__(self, client_id: object) -> bool: ...

    def __len__(self) -> int: ...


class MemoryClientState:
    """Every client's state in memory (tensors kept on the device they came from)."""

    def __init__(self) -> None:
        self._states: dict[str, State] = {}

    def get(self, client_id: str) -> State:
        return dict(self._states.get(client_id, {}))

    def put(self, client_id: str, state: State) -> None:
        self._states[client_id] = {k: v.detach() for k, v in state.items()}

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._states

    def __len__(self) -> int:
        return len(self._states)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def state_file_name(client_id: str) -> str:
    """A file name for ``client_id``: its safe characters and a digest (ids that differ only in
    unsafe characters, or a name like ``..``, cannot collide or escape the folder)."""
    digest = hashlib.blake2b(client_id.encode(), digest_size=6).hexdigest()
    return f"{_UNSAFE.sub('_', client_id)[:64]}-{digest}.safetensors"


class DiskClientState:
    """One safetensors file per client in ``folder`` (memory O(cohort), not O(population)).

    Tensors are read onto ``device``; a write goes to a temporary file renamed into place, so a
    run killed mid-write leaves the client's previous state, never half a file."""

    def __init__(self, folder: str | Path, device: torch.device | str = "cpu"):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.device = str(device)

    def _path(self, client_id: str) -> Path:
        return self.folder / state_file_name(client_id)

    def get(self, client_id: str) -> State:
        path = self._path(client_id)
        if not path.exists():
            return {}
        return load_file(str(path), device=self.device)

    def put(self, client_id: str, state: State) -> None:
        path = self._path(client_id)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp))
        os.replace(tmp, path)

    def __contains__(self, client_id: object) -> bool:
        return isinstance(client_id, str) and self._path(client_id).exists()

    def __len__(self) -> int:
        return sum(1 for _ in self.folder.glob("*.safetensors"))


class StateMapping:
    """One named tensor of each client's state in a store, used like a dict keyed by client
    (``get``, ``[c]``, ``in``, ``pop``): top-k error feedback's residuals on disk."""

    def __init__(self, store: ClientState, name: str):
        self.store, self.name = store, name

    def get(self, client_id: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.store.get(client_id).get(self.name, default)

    def __getitem__(self, client_id: str) -> torch.Tensor:
        t = self.get(client_id)
        if t is None:
            raise KeyError(client_id)
        return t

    def __setitem__(self, client_id: str, value: torch.Tensor) -> None:
        self.store.put(client_id, {**self.store.get(client_id), self.name: value})

    def __contains__(self, client_id: object) -> bool:
        return isinstance(client_id, str) and self.get(client_id) is not None

    def pop(self, client_id: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        state = self.store.get(client_id)
        value = state.pop(self.name, default)
        if client_id in self.store:
            self.store.put(client_id, state)
        return value


def make_client_state(folder: str, device: torch.device | str = "cpu") -> ClientState:
    """``algorithm.state_dir``: "" keeps every client's state in memory, a folder keeps it on disk."""
    if folder:
        log.info("client state on disk in %s", folder)
        return DiskClientState(folder, device)
    return MemoryClientState()
