"""The client-state stores: what a client keeps between rounds comes back as it was put."""

from __future__ import annotations

import torch

from shoal.client.state import DiskClientState, MemoryClientState, make_client_state, state_file_name


def test_memory_and_disk_stores_give_back_what_was_put(tmp_path):
    state = {"scaffold/c": torch.arange(5.0), "buffer/bn.running_mean": torch.ones(3)}
    for store in (MemoryClientState(), DiskClientState(tmp_path / "s")):
        assert store.get("a") == {} and "a" not in store
        store.put("a", state)
        back = store.get("a")
        assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
        store.put("a", {"scaffold/c": torch.zeros(5)})  # replaces the whole state
        assert set(store.get("a")) == {"scaffold/c"} and len(store) == 1 and "a" in store


def test_disk_store_holds_nothing_in_memory_and_names_files_safely(tmp_path):
    store = make_client_state(str(tmp_path / "s"))
    store.put("../x", {"t": torch.ones(2)})
    store.put("__x", {"t": torch.zeros(2)})  # same safe characters, another client
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(
        [state_file_name("../x"), state_file_name("__x")]
    )
    assert torch.equal(DiskClientState(tmp_path / "s").get("../x")["t"], torch.ones(2))  # a new store reads it
    assert isinstance(make_client_state(""), MemoryClientState)
