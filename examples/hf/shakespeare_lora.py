"""Federated LoRA fine-tuning of a small GPT-2 on Shakespeare: one client per speaking role.

A Hugging Face ``GPT2LMHeadModel`` is pre-trained centrally on one part of
``../shared/datasets/tinyshakespeare/input.txt`` (``pretrain.py`` saves it to a local folder),
then fine-tuned federatedly with LoRA adapters on the other part, one client per speaking
role (naturally non-IID); the frozen base stays on every node and only the adapters travel.

Run it (from the repository root)::

    python examples/hf/pretrain.py --out runs/hf/base                 # the base, a few minutes
    shoal simulate -c examples/hf/shakespeare_lora.toml --out runs/hf/fed
    python examples/hf/baselines.py -c examples/hf/shakespeare_lora.toml --out runs/hf/baselines

The split (the same for every seed; the roles are the play's):

- the ``clients + heldout`` roles with the most lines are the fine-tuning part: every
  ``(clients + heldout) // heldout``-th of them (by size) is a held-out role, never trained on,
  whose text is the central test set; the others are the clients, each of which also keeps
  every 10th speech as its own test text (``fed_*`` metrics);
- every other role is the pre-training part (``pretrain.py``).

Tokenizer: characters, a fixed 98-symbol vocabulary (newline, printable ASCII, one id for
anything else), so every node maps text to the same ids with no download. A role's text is
cut into blocks of ``seq_len`` tokens; its last, shorter block is padded by the task's
collate function (padding is masked out of attention and labels).

Task arguments (``[task.args]``): ``base`` (the pre-trained folder, default ``runs/hf/base``;
or a config table, e.g. ``{model_type = "gpt2", n_embd = 32, n_layer = 2, n_head = 2}``, to
start from a freshly initialised model), ``clients`` (20), ``heldout`` (4), ``seq_len`` (64),
``rank`` (8), ``alpha`` (16), ``targets`` (``["c_attn"]``), ``path`` (the corpus),
``pooled`` (false: true pools every client's training text into one client, for the central
LoRA baseline), ``max_chars`` (0: each role's train, test and held-out text cut to this many
characters, for quick runs).

``--data PATH`` for ``shoal client`` / ``shoal peer``: a folder with ``train.txt`` (and
optionally ``test.txt``), or one ``.txt`` file; ``python examples/hf/shakespeare_lora.py
write-roles DIR --roles 3`` writes the clients' folders.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch

from shoal.hf import IGNORE_INDEX, HFTask, pad_collate
from shoal.task import DictDataset, LocalData, SimulationData, TaskError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))
from shakespeare import VOCAB_SIZE, encode, find_corpus, parse_roles, split_role  # noqa: E402  (the text example's parsing)

PAD_ID = 0  # the "unknown character" id pads; padded positions are masked and carry no label
MIN_BLOCK = 8  # a role's last block shorter than this is dropped


def gpt2_config(n_embd: int = 64, n_layer: int = 2, n_head: int = 4, seq_len: int = 64) -> dict[str, Any]:
    """A small GPT-2 over the character vocabulary (no dropout: the runs compare optimisation)."""
    return {
        "model_type": "gpt2",
        "vocab_size": VOCAB_SIZE,
        "n_positions": seq_len,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": PAD_ID,
        "eos_token_id": PAD_ID,
        "pad_token_id": PAD_ID,
    }


def blocks(text: str, seq_len: int) -> DictDataset:
    """Text -> dict examples of ``seq_len`` tokens (the last one padded; ``labels`` = the ids,
    shifted by the model, IGNORE_INDEX on padding)."""
    ids = encode(text)
    chunks = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    chunks = [c for c in chunks if len(c) >= MIN_BLOCK]
    n = len(chunks)
    input_ids = torch.full((n, seq_len), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((n, seq_len), dtype=torch.int64)
    for i, c in enumerate(chunks):
        input_ids[i, : len(c)] = c
        mask[i, : len(c)] = 1
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    return DictDataset(input_ids=input_ids, attention_mask=mask, labels=labels)


def split_play(corpus: Path, clients: int, heldout: int) -> tuple[list[tuple[str, list[str]]], list[str], list[str]]:
    """(client roles [(name, speeches)], held-out roles' speeches, pre-training roles' speeches)."""
    roles = parse_roles(corpus.read_text(encoding="utf-8"))
    ranked = sorted(roles, key=lambda name: (-sum(map(len, roles[name])), name))
    part = ranked[: clients + heldout]
    every = max(1, len(part) // max(heldout, 1))
    held = [name for i, name in enumerate(part) if heldout and i % every == every - 1][:heldout]
    fed = [name for name in part if name not in held]
    pretrain = [s for name in ranked[clients + heldout :] for s in roles[name]]
    return [(name, roles[name]) for name in fed], [s for name in held for s in roles[name]], pretrain


def role_id(name: str) -> str:
    return re.sub(r"\W+", "_", name.lower()).strip("_")


class ShakespeareLoRA(HFTask):
    optimizer = "adamw"  # a fresh AdamW per local training (lr = train.lr)
    collate_fn = staticmethod(pad_collate(PAD_ID))

    def __init__(
        self,
        base: Any = "runs/hf/base",
        clients: int = 20,
        heldout: int = 4,
        seq_len: int = 64,
        rank: int = 8,
        alpha: float = 16.0,
        targets: list[str] | None = None,
        path: str | None = None,
        pooled: bool = False,
        max_chars: int = 0,
    ):
        if isinstance(base, str) and not Path(base).exists():
            raise TaskError(
                f"shakespeare_lora: no base model at {base!r}; run `python examples/hf/pretrain.py --out {base}` "
                "first, or give task.args.base a config table"
            )
        peft = {"r": rank, "lora_alpha": alpha, "target_modules": list(targets or ["c_attn"]), "lora_dropout": 0.0}
        if isinstance(base, dict):
            base = {**gpt2_config(seq_len=seq_len), **base}
        super().__init__(base, kind="causal-lm", peft=peft)
        self.clients, self.heldout, self.seq_len, self.path, self.pooled = clients, heldout, seq_len, path, pooled
        self.max_chars = max_chars

    def describe(self) -> str:
        return f"GPT-2 + LoRA on Shakespeare roles ({self.clients} clients)"

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        fed, held, _ = split_play(find_corpus(self.path), min(num_clients, self.clients), self.heldout)
        train, client_test, ids = [], [], []
        for name, speeches in fed:
            train_text, test_text = self._cut(*split_role(speeches))
            train.append(train_text)
            client_test.append(blocks(test_text, self.seq_len) if test_text else None)
            ids.append(role_id(name))
        central = blocks(self._cut("\n\n".join(held))[0], self.seq_len) if held else None
        if self.pooled:
            return SimulationData(train=[blocks("\n\n".join(train), self.seq_len)], test=central, client_ids=["pooled"])
        return SimulationData(
            train=[blocks(t, self.seq_len) for t in train], test=central, client_test=client_test, client_ids=ids
        )

    def central_test_data(self) -> DictDataset | None:
        """The held-out roles' text, when the corpus is there (else nodes evaluate on their own)."""
        try:
            _, held, _ = split_play(find_corpus(self.path), self.clients, self.heldout)
        except TaskError:
            return None
        return blocks(self._cut("\n\n".join(held))[0], self.seq_len) if held else None

    def _cut(self, *texts: str) -> tuple[str, ...]:
        """Each text's first ``max_chars`` characters (0: all; small runs and tests)."""
        return tuple(t[: self.max_chars] if self.max_chars else t for t in texts)

    def local_data(self, path: Path) -> LocalData:
        path = Path(path)
        train_file = path / "train.txt" if path.is_dir() else path
        test_file = path / "test.txt" if path.is_dir() else None
        if not train_file.is_file():
            raise TaskError(f"shakespeare_lora: no {train_file}; --data is a folder with train.txt or one .txt file")
        train = blocks(self._cut(train_file.read_text(encoding="utf-8"))[0], self.seq_len)
        if len(train) == 0:
            raise TaskError(f"shakespeare_lora: {train_file} has fewer than {MIN_BLOCK} characters")
        test = None
        if test_file is not None and test_file.is_file():
            test = blocks(self._cut(test_file.read_text(encoding="utf-8"))[0], self.seq_len)
        return LocalData(train=train, test=test if test is not None and len(test) else None)


task = ShakespeareLoRA


def write_roles(out: Path, roles: int, clients: int = 20, heldout: int = 4, path: str | None = None) -> list[Path]:
    """``DIR/<role>/train.txt`` and ``test.txt`` for the first ``roles`` clients, for ``--data``."""
    fed, _, _ = split_play(find_corpus(path), clients, heldout)
    folders = []
    for name, speeches in fed[:roles]:
        folder = out / role_id(name)
        folder.mkdir(parents=True, exist_ok=True)
        train_text, test_text = split_role(speeches)
        (folder / "train.txt").write_text(train_text, encoding="utf-8")
        (folder / "test.txt").write_text(test_text, encoding="utf-8")
        folders.append(folder)
    return folders


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write per-role text folders for shoal client/peer --data.")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-roles", help="DIR/<role>/train.txt and test.txt for the first clients")
    w.add_argument("out", type=Path)
    w.add_argument("--roles", type=int, default=3)
    w.add_argument("--path", default=None, help="the corpus (default: ../shared/datasets/tinyshakespeare/input.txt)")
    args = parser.parse_args()
    for f in write_roles(args.out, args.roles, path=args.path):
        print(f)
