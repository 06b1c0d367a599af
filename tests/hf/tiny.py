"""The federated LoRA example (examples/hf/shakespeare_lora.py) at test size: a GPT-2 of 32
dimensions built from a config, rank-8 LoRA on its attention (2,048 adapter parameters),
three role clients of at most 3,000 characters each, one held-out role."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TASK = f"{REPO / 'examples' / 'hf' / 'shakespeare_lora.py'}:task"
CORPUS = REPO.parent / "shared" / "datasets" / "tinyshakespeare" / "input.txt"
ADAPTER_NUMEL = 2 * (8 * 32 + 96 * 8)  # 2 layers x (A: r x d, B: 3d x r) on c_attn

# [task.args] as a TOML table body, and the same as --set overrides
ARGS = {
    "base": "{n_embd = 32, n_layer = 2, n_head = 2}",
    "clients": "3",
    "heldout": "1",
    "seq_len": "32",
    "rank": "8",
    "max_chars": "3000",
}
TOML_ARGS = "\n".join(f"{k} = {v}" for k, v in ARGS.items())
OVERRIDES = [f"task.app='{TASK}'", *(f"task.args.{k}={v}" for k, v in ARGS.items())]

needs_corpus = pytest.mark.skipif(not CORPUS.is_file(), reason=f"{CORPUS} is not there")


def base_numel() -> int:
    """The whole tiny model's parameter count: what would travel without adapters."""
    import torch

    from shoal.task import load_task

    task = load_task(TASK, {"base": {"n_embd": 32, "n_layer": 2, "n_head": 2}, "clients": 3, "heldout": 1})
    torch.manual_seed(0)
    return sum(p.numel() for p in task.model().parameters())
