"""Your own task, example 1: a character-level language model of Shakespeare, one client per role.

Every speaking role in the plays is one client (naturally non-IID, as LEAF's Shakespeare
benchmark): GLOUCESTER's lines train one client, JULIET's another. The model reads 80
characters and predicts, at every position, the next character.

Run it (from the repository root; the corpus is ../shared/datasets/tinyshakespeare/input.txt)::

    shoal simulate --task examples/tasks/shakespeare.py:task -c examples/tasks/shakespeare.toml
    shoal simulate --task examples/tasks/shakespeare.py:task --set 'task.args={max_roles = 10}'

What it shows of the task API (shoal/task.py, docs/tasks.md):

- ``model()``: an embedding + LSTM + linear head, logits of shape (batch, seq_len, vocab);
- ``loss()``: cross-entropy over every position of the (B, T, V) logits (the default
  cross-entropy expects (B, C) logits, so this task gives its own);
- ``metrics()``: loss and accuracy per character; ``summarize()`` adds perplexity = exp(loss),
  computed from the example-weighted mean loss;
- ``simulation_data()``: one client per role, each with its own held-out test lines
  (``client_test``) and a central test set (all clients' test lines together);
- ``local_data(path)``: a deployed node's or peer's own text (format below).

Task arguments (``[task.args]`` in TOML, or ``--set 'task.args={...}'``):
``path`` (the corpus; default: found as ``shared/datasets/tinyshakespeare/input.txt`` in a
folder above this file, i.e. ``../shared/datasets`` beside the repository), ``seq_len`` (80),
``max_roles`` (40; the simulation has min(simulation.num_clients, max_roles, roles with at
least ``min_chars``) clients, the roles with the most lines first), ``min_chars`` (2000),
``embed_dim`` (32), ``hidden`` (128), ``layers`` (1).

Text and split. The corpus is blocks separated by blank lines, each ``SPEAKER:`` on its own
line followed by that speaker's lines. A role's text is its speeches, separated by blank
lines. Every 10th speech of a role (the 10th, 20th, ...) is held out as that role's test
text; the rest is its training text. Text becomes sequences of ``seq_len`` + 1 characters
(consecutive, sharing one character): x = the first ``seq_len`` characters (int64 ids),
y = the same shifted by one. Characters outside printable ASCII map to one "unknown" id.

``--data PATH`` format for ``shoal client`` / ``shoal peer`` (``local_data``):

- a folder holding ``train.txt`` (required) and ``test.txt`` (optional): UTF-8 text, this
  role's lines as they appear in the play (speeches separated by blank lines, no speaker
  headers, though any text works); or
- a single ``.txt`` file: training text only, no test data.

``python examples/tasks/shakespeare.py write-roles DIR --roles 3`` writes such folders
(``DIR/<role>/train.txt``, ``test.txt``) for the largest roles, with exactly the split the
simulation uses.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shoal.task import LocalData, SimulationData, Task, TaskError

# A fixed vocabulary, so every node (which sees only its own text) maps characters to the
# same ids: id 0 = any character not listed, then newline and printable ASCII.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB) + 1
_IDS = {c: i + 1 for i, c in enumerate(VOCAB)}
TEST_EVERY = 10  # every 10th speech of a role is its held-out test text
CORPUS = Path("shared") / "datasets" / "tinyshakespeare" / "input.txt"


def encode(text: str) -> torch.Tensor:
    """Characters -> int64 ids (0 for characters outside the vocabulary)."""
    return torch.tensor([_IDS.get(c, 0) for c in text], dtype=torch.int64)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i - 1] if i > 0 else "?" for i in ids.tolist())


def sequences(text: str, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive windows of ``seq_len`` + 1 characters -> x (N, T) and y (N, T), y = x shifted by one."""
    ids = encode(text)
    n = max(0, (len(ids) - 1) // seq_len)
    x = ids[: n * seq_len].view(n, seq_len)
    y = ids[1 : n * seq_len + 1].view(n, seq_len)
    return x, y


def find_corpus(path: str | None) -> Path:
    """The corpus file: ``path`` if given (relative to the working directory or to the
    repository), else ``shared/datasets/...`` in the nearest folder above this file that has it."""
    here = Path(__file__).resolve()
    if path:
        p = Path(path).expanduser()
        for candidate in (p, here.parents[2] / p):
            if candidate.is_file():
                return candidate
        raise TaskError(
            f"shakespeare: corpus {path!r} not found (task arg path); give the path to tinyshakespeare/input.txt"
        )
    for folder in here.parents:
        if (folder / CORPUS).is_file():
            return folder / CORPUS
    raise TaskError(
        f"shakespeare: {CORPUS} not found in any folder above {here.parent}; put the corpus at "
        "../shared/datasets/tinyshakespeare/input.txt beside the repository or set the task arg path"
    )


def parse_roles(text: str) -> dict[str, list[str]]:
    """The play text -> {speaker: [speech, ...]} in order of appearance."""
    roles: dict[str, list[str]] = {}
    speaker = None
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip("\n").split("\n")
        if not lines or not lines[0].strip():
            continue
        head = lines[0].strip()
        if head.endswith(":") and len(head) > 1:
            speaker, lines = head[:-1], lines[1:]
        if speaker is None or not lines:
            continue  # text before the first speaker, or a header alone
        roles.setdefault(speaker, []).append("\n".join(lines))
    return roles


def split_role(speeches: list[str]) -> tuple[str, str]:
    """A role's (train text, test text): every TEST_EVERY-th speech is held out."""
    train = [s for i, s in enumerate(speeches) if i % TEST_EVERY != TEST_EVERY - 1]
    test = [s for i, s in enumerate(speeches) if i % TEST_EVERY == TEST_EVERY - 1]
    return "\n\n".join(train), "\n\n".join(test)


def largest_roles(corpus: Path, max_roles: int, min_chars: int) -> list[tuple[str, str, str]]:
    """[(role, train text, test text)] of the roles with at least ``min_chars`` characters,
    the largest first (ties by name), at most ``max_roles``."""
    roles = parse_roles(corpus.read_text(encoding="utf-8"))
    sized = sorted(((sum(map(len, s)), name) for name, s in roles.items()), key=lambda t: (-t[0], t[1]))
    chosen = [name for size, name in sized if size >= min_chars][:max_roles]
    return [(name, *split_role(roles[name])) for name in chosen]


class CharLSTM(nn.Module):
    """Embedding -> LSTM -> linear: next-character logits at every position, shape (B, T, V)."""

    def __init__(self, vocab: int, embed_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out)


class Shakespeare(Task):
    num_classes = VOCAB_SIZE  # what a label-flipping attack flips among

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 80,
        max_roles: int = 40,
        min_chars: int = 2000,
        embed_dim: int = 32,
        hidden: int = 128,
        layers: int = 1,
    ):
        if seq_len < 1 or max_roles < 1:
            raise TaskError(f"shakespeare: seq_len ({seq_len}) and max_roles ({max_roles}) must be >= 1")
        self.path, self.seq_len, self.max_roles, self.min_chars = path, seq_len, max_roles, min_chars
        self.embed_dim, self.hidden, self.layers = embed_dim, hidden, layers

    def describe(self) -> str:
        return f"shakespeare char-LSTM ({self.hidden} hidden)"

    def model(self) -> nn.Module:
        return CharLSTM(VOCAB_SIZE, self.embed_dim, self.hidden, self.layers)

    def loss(self, model, x, y):
        logits = model(x).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def metrics(self, model, x, y):
        # Means over the batch's characters; every sequence has seq_len characters, so shoal's
        # example-(sequence-)weighted average of these is the mean per character.
        logits = model(x).float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return {"loss": loss, "accuracy": (logits.argmax(-1) == y).float().mean()}

    def summarize(self, means):
        return {**means, "perplexity": math.exp(min(means["loss"], 50.0))}

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        # The split is the play's (one client per role), the same for every seed.
        roles = largest_roles(find_corpus(self.path), min(num_clients, self.max_roles), self.min_chars)
        if not roles:
            raise TaskError(f"shakespeare: no role has {self.min_chars} characters of lines; lower min_chars")
        train, client_test, ids = [], [], []
        for name, train_text, test_text in roles:
            train.append(sequences(train_text, self.seq_len))
            x, y = sequences(test_text, self.seq_len)
            client_test.append((x, y) if len(y) else None)
            ids.append(re.sub(r"\W+", "_", name.lower()).strip("_"))
        test = [t for t in client_test if t is not None]
        central = (torch.cat([t[0] for t in test]), torch.cat([t[1] for t in test])) if test else None
        return SimulationData(train=train, test=central, client_test=client_test, client_ids=ids)

    def local_data(self, path: Path) -> LocalData:
        path = Path(path)
        if path.is_dir():
            train_file, test_file = path / "train.txt", path / "test.txt"
            if not train_file.is_file():
                raise TaskError(
                    f"shakespeare: {path} has no train.txt; --data is a folder with train.txt "
                    "(and optionally test.txt), or one .txt file"
                )
        elif path.is_file():
            train_file, test_file = path, None
        else:
            raise TaskError(
                f"shakespeare: --data {str(path)!r} does not exist; give a folder with train.txt "
                "(and optionally test.txt), or one .txt file"
            )
        train = self._read(train_file)
        if len(train[1]) == 0:
            raise TaskError(
                f"shakespeare: {train_file} has fewer than {self.seq_len + 1} characters, not one training sequence"
            )
        test = self._read(test_file) if test_file is not None and test_file.is_file() else None
        return LocalData(train=train, test=test if test is not None and len(test[1]) else None)

    def _read(self, file: Path) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TaskError(f"shakespeare: cannot read {file} as UTF-8 text: {e}") from None
        return sequences(text, self.seq_len)

    def central_test_data(self):
        """What ``shoal server`` evaluates on: every role's test lines, if the corpus is there."""
        try:
            return self.simulation_data(self.max_roles, 0).test
        except TaskError:
            return None  # an aggregator without the corpus: the nodes evaluate on their own test text


task = Shakespeare


def write_roles(out: Path, roles: int, path: str | None = None, min_chars: int = 2000) -> list[Path]:
    """One folder per role (the largest first) with its train.txt and test.txt, for ``--data``."""
    folders = []
    for name, train_text, test_text in largest_roles(find_corpus(path), roles, min_chars):
        folder = out / re.sub(r"\W+", "_", name.lower()).strip("_")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.txt").write_text(train_text, encoding="utf-8")
        (folder / "test.txt").write_text(test_text, encoding="utf-8")
        folders.append(folder)
    return folders


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write per-role text folders for shoal client/peer --data.")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-roles", help="DIR/<role>/train.txt and test.txt for the largest roles")
    w.add_argument("out", type=Path)
    w.add_argument("--roles", type=int, default=3)
    w.add_argument("--path", default=None, help="the corpus (default: ../shared/datasets/tinyshakespeare/input.txt)")
    args = parser.parse_args()
    try:
        for f in write_roles(args.out, args.roles, args.path):
            print(f)
    except TaskError as e:
        raise SystemExit(f"error: {e}") from None
