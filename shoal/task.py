"""The task API: the user's model, loss, metrics and data, which every shoal job loads.

A task is a Python object (usually a subclass of :class:`Task`) that a user writes in
their own file or package and names on every command as ``--task path/to/file.py:name``
or ``--task package.module:name`` (TOML: ``[task] app = "..."`` plus a ``[task.args]``
table passed to it). ``name`` may be a Task instance, a Task subclass or a function that
returns a Task; a class or function is called with ``[task.args]`` as keyword arguments.

What a task gives (docs/tasks.md has the full reference):

- :meth:`Task.model` the ``nn.Module`` (any architecture);
- :meth:`Task.loss` its loss on a batch (default: cross-entropy of ``model(x)`` on ``y``);
- :meth:`Task.metrics` evaluation metrics as per-batch means (default: loss, accuracy),
  which shoal averages weighted by examples, and :meth:`Task.summarize` for figures
  derived from the means (a language model's perplexity);
- :meth:`Task.simulation_data` per-client training data (and optionally per-client
  and central test data) for ``shoal simulate``;
- :meth:`Task.population` (optional) instead, a :class:`Population`: clients whose data
  are loaded one client at a time when a round selects them, for populations far larger
  than a round (100,000 clients, 1,000 a round) whose data never sit in memory at once;
- :meth:`Task.local_data` a deployed node's or peer's own data, read from ``--data PATH``;
- :meth:`Task.central_test_data` (optional) a test set ``shoal server`` evaluates on;
- which state is exchanged: trainable parameters always, float buffers (BatchNorm
  statistics) unless :attr:`Task.exchange_buffers` is False (FedBN); frozen parameters
  (``requires_grad = False``) never leave the node;
- optionally a ``torch.optim`` optimizer by name, a collate function, DataLoader workers.

Data is either a pair of tensors ``(x, y)`` (the fast path: held on the device once and
sliced) or any map-style ``torch.utils.data.Dataset`` whose items are ``(x, y)`` or dicts of
tensors (read through a DataLoader, for data that does not fit in memory).

A batch is an ``(x, y)`` pair, or a dict of tensors as Hugging Face models take them
(``input_ids``, ``attention_mask``, ``labels``): the whole dict is ``x`` (the model is called
as ``model(**x)``) and its ``labels`` entry is ``y`` (:func:`split_batch`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from .errors import ShoalError

log = logging.getLogger(__name__)

# Client data: a pair of tensors (x, y), first dimension = examples, or a torch Dataset of (x, y).
ClientData = tuple[torch.Tensor, torch.Tensor] | Dataset

OPTIMIZERS = ("sgd", "adam", "adamw")


class TaskError(ShoalError):
    """The user's task cannot be loaded or gives something shoal cannot use."""

    code = "bad_task"


@dataclass
class SimulationData:
    """What ``shoal simulate`` trains on: one training set per client, optional test sets.

    ``train[i]`` is client i's data; ``client_test[i]`` (optional) its own test data for
    federated evaluation; ``test`` (optional) a central held-out set. ``client_ids``
    default to ``client-00000``, ``client-00001``, ...
    """

    train: Sequence[ClientData]
    test: ClientData | None = None
    client_test: Sequence[ClientData | None] | None = None
    client_ids: Sequence[str] | None = None


class Population:
    """A simulated population whose clients' data are loaded on demand, one client at a time.

    Subclass it and return it from :meth:`Task.population`: the in-process simulator then
    holds only each client's id and example count, and loads ``train_data(i)`` when a round
    selects client i (memory O(round), not O(population)). Everything here must be a pure
    function of the index (and whatever the population was built from), so that a worker
    that rebuilds the task in another process gets the same client i.
    """

    def __len__(self) -> int:
        """How many clients (normally ``simulation.num_clients``)."""
        raise NotImplementedError

    def client_id(self, i: int) -> str:
        """Client i's name (default ``client-00042``, the same as a SimulationData's)."""
        return f"client-{i:05d}"

    def num_examples(self, i: int) -> int:
        """Client i's number of training examples, WITHOUT loading its data: update weights,
        privacy accounting and memory budgets read it for every client."""
        raise NotImplementedError

    def train_data(self, i: int) -> ClientData:
        """Client i's training data (an (x, y) tensor pair or a Dataset), loaded now."""
        raise NotImplementedError

    def test_data(self, i: int) -> ClientData | None:
        """Client i's own test data for federated evaluation (default: none)."""
        return None


@dataclass
class LocalData:
    """A deployed node's or peer's own data: training data and optional test data."""

    train: ClientData
    test: ClientData | None = None


class Task:
    """Base class of a task; override what differs from the defaults.

    Subclasses must implement :meth:`model`, and :meth:`simulation_data` and/or
    :meth:`local_data` for the jobs they are used in.
    """

    #: exchange float buffers (BatchNorm running statistics) with the parameters;
    #: False keeps them on each client (FedBN, Li et al. 2021).
    exchange_buffers: bool = True
    #: parameters that stay on each client under algorithm.name = "fedper" / "fedrep": names or
    #: module prefixes, e.g. ``("head",)`` keeps ``head.weight`` and ``head.bias`` local.
    personal: tuple[str, ...] = ()
    #: None: shoal's SGD (train.lr, momentum, weight_decay, prox_mu) on the flat buffer;
    #: "sgd" | "adam" | "adamw": that torch.optim class, lr = train.lr unless given here.
    optimizer: str | None = None
    optimizer_args: dict[str, Any] = {}
    #: DataLoader settings for Dataset data (tensor pairs need none).
    collate_fn: Callable[[list[Any]], Any] | None = None
    num_workers: int = 0

    def model(self) -> nn.Module:
        """A freshly initialised model (shoal seeds torch before calling this)."""
        raise NotImplementedError

    def loss(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        """The scalar training loss of one batch (default: the loss the model's output carries,
        as a Hugging Face model's does when given ``labels``; else cross-entropy of its logits)."""
        out = forward(model, x)
        own = getattr(out, "loss", None)
        if isinstance(own, torch.Tensor):
            return own
        return F.cross_entropy(logits_of(out).float(), y)

    def metrics(self, model: nn.Module, x: Any, y: torch.Tensor) -> dict[str, torch.Tensor | float]:
        """Per-batch means; shoal averages them over batches weighted by examples."""
        out = logits_of(forward(model, x)).float()
        n = y.shape[0]  # means computed in float64 from sums, so example-weighting recovers exact totals
        return {
            "loss": F.cross_entropy(out, y, reduction="sum").double() / n,
            "accuracy": (out.argmax(-1) == y).sum().double() / n,
        }

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """Figures derived from the example-weighted means (e.g. perplexity = exp(loss))."""
        return metrics

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        """Per-client data for ``shoal simulate`` (``num_clients`` is ``simulation.num_clients``)."""
        raise NotImplementedError

    def population(self, num_clients: int, seed: int) -> Population | None:
        """A lazily loaded population for ``shoal simulate`` (in-process engine), or None
        (the default) to use :meth:`simulation_data`. Its central test set is
        :meth:`central_test_data`."""
        return None

    def local_data(self, path: Path) -> LocalData:
        """This node's own data, read from ``--data PATH`` in whatever format the task uses."""
        raise NotImplementedError

    def central_test_data(self) -> ClientData | None:
        """A held-out set the aggregator server evaluates each new version on (default: none;
        a real aggregator usually has no data, and nodes evaluate on their own test data)."""
        return None

    def to_device(self, batch: Any, device: torch.device) -> Any:
        """Move one batch (tensors, or tuples/lists/dicts of them) to ``device``."""
        return move_to(batch, device)


class Inputs(dict):
    """The inputs of a dict batch (Hugging Face style): the model takes them as keyword
    arguments, ``model(**x)``. A plain dict ``x`` of an ``(x, y)`` pair is one argument,
    ``model(x)``, as before dict batches existed."""


def forward(model: nn.Module, x: Any) -> Any:
    """The model on a batch's inputs: ``model(**x)`` for a dict batch's :class:`Inputs`, else ``model(x)``."""
    return model(**x) if isinstance(x, Inputs) else model(x)


def logits_of(out: Any) -> torch.Tensor:
    """A model's output as one logits tensor: the tensor itself, or the ``logits`` of a
    Hugging Face-style output object."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(out).__name__}, neither a tensor nor an output with logits")
    return logits


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """One batch -> ``(x, y)``: an ``(x, y)`` pair as it is; a dict of tensors (Hugging Face
    style) whole as ``x`` (an :class:`Inputs`: the default loss calls ``model(**x)``), with its
    ``labels`` as ``y`` (the model computes its loss from them).

    ``y``'s first dimension counts the batch's examples (metrics are weighted by it)."""
    if isinstance(batch, Mapping):
        y = batch.get("labels")
        if not isinstance(y, torch.Tensor):
            keys = ", ".join(map(str, batch)) or "none"
            raise ValueError(f"a dict batch needs a 'labels' tensor (its keys: {keys})")
        return Inputs(batch), y
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"a batch is a {type(batch).__name__}; expected an (x, y) pair or a dict of tensors with 'labels'")


class DictDataset(Dataset):
    """Equal-length tensors as a Dataset of dicts: item i is ``{name: tensor[i]}`` (a Hugging
    Face-style example: ``DictDataset(input_ids=ids, attention_mask=mask, labels=labels)``);
    the default collate stacks a batch of them back into one dict of tensors."""

    def __init__(self, **tensors: torch.Tensor):
        if not tensors:
            raise ValueError("DictDataset needs at least one tensor")
        sizes = {name: int(t.shape[0]) for name, t in tensors.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"DictDataset tensors differ in length: {sizes}")
        self.tensors = tensors
        self.n = next(iter(sizes.values()))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: t[i] for name, t in self.tensors.items()}


def move_to(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(o, device, non_blocking) for o in obj)
    if isinstance(obj, dict):
        return {k: move_to(v, device, non_blocking) for k, v in obj.items()}
    return obj


def num_examples(data: ClientData) -> int:
    if isinstance(data, tuple):
        return int(data[1].shape[0])
    return len(data)  # type: ignore[arg-type]


def as_tensors(data: ClientData) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, y)`` when the data is held as two tensors (a pair or a TensorDataset), else None."""
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return data[0], data[1]
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        return data.tensors[0], data.tensors[1]
    return None


# --- loading a task by name -------------------------------------------------------------


def _import_file(path: Path, spec_text: str) -> Any:
    if not path.is_file():
        raise TaskError(f"task {spec_text}: file {str(path)!r} not found; give path/to/file.py:name")
    mod_name = f"shoal_task_{abs(hash(str(path.resolve()))):x}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"task {spec_text}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    folder = str(path.resolve().parent)  # so the task file can import its neighbours
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise TaskError(f"task {spec_text}: importing {path} failed: {type(e).__name__}: {e}") from None
    return module


def load_task(spec_text: str, args: dict[str, Any] | None = None) -> Task:
    """``path/to/file.py:name`` or ``package.module:name`` -> the Task it names."""
    args = dict(args or {})
    target, sep, attr = spec_text.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise TaskError(
            f"task {spec_text}: expected path/to/file.py:name or package.module:name "
            "(the name of a Task, a Task subclass or a function returning one)"
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(Path(target).expanduser(), spec_text)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise TaskError(f"task {spec_text}: cannot import module {target!r}: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        names = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise TaskError(f"task {spec_text}: {target} has no attribute {attr!r} (it has: {', '.join(names)})")
    obj = getattr(module, attr)
    if isinstance(obj, Task) or (not callable(obj) and _looks_like_task(obj)):
        if args:
            raise TaskError(
                f"task {spec_text} is an instance; [task.args] ({', '.join(args)}) can only be "
                "passed to a Task class or a function that returns one"
            )
        task = obj
    elif callable(obj):
        try:
            inspect.signature(obj).bind(**args)
        except TypeError as e:
            raise TaskError(f"task {spec_text}: [task.args] do not fit {attr}: {e}") from None
        except ValueError:
            pass
        try:
            task = obj(**args)
        except ShoalError:
            raise
        except Exception as e:
            raise TaskError(f"task {spec_text}: calling {attr}(**task.args) failed: {type(e).__name__}: {e}") from None
    else:
        raise TaskError(f"task {spec_text}: {attr} is a {type(obj).__name__}, not a Task")
    if not _looks_like_task(task):
        raise TaskError(
            f"task {spec_text}: {attr} gave a {type(task).__name__}, which has no model() method; "
            "subclass shoal.Task and implement model()"
        )
    task.__dict__.setdefault("_shoal_name", spec_text)
    return task


def _looks_like_task(obj: Any) -> bool:
    return callable(getattr(obj, "model", None))


def task_name(task: Task) -> str:
    return getattr(task, "_shoal_name", None) or type(task).__name__


# --- checks: one clear line instead of a traceback deep inside training ------------------


LOSS_PART = "loss(model, x, y)"


class UserCodeError(TaskError):
    """The user's task code raised: ``part`` names which call (``loss(model, x, y)``, ``dataset[i]``,
    ``metrics(model, x, y)``, ...), ``exc_type`` the exception's class. :meth:`public` is what may
    leave a node whose data is protected by DP: the part and the type, never the message (it can
    quote a label, a file name, a value of the data)."""

    def __init__(self, message: str, task: str, part: str, exc_type: str):
        super().__init__(message)
        self.task, self.part, self.exc_type = task, part, exc_type

    def public(self) -> str:
        return f"task {self.task}: {self.part} raised {self.exc_type}"


def fix_hint(part: str, e: BaseException) -> str:
    """A fix for the commonest mistakes at each part, read off the exception (empty: none known)."""
    text = str(e)
    if "out of bounds" in text and ("Target" in text or part.startswith(("loss", "metrics"))):
        return "the model gives fewer outputs (classes) than the labels need: give model() one output per class"
    if isinstance(e, RuntimeError) and ("shape" in text or "size" in text) and part.startswith(("loss", "metrics")):
        return "the model's output and the targets do not fit: check model()'s last layer and the labels' shape"
    if part.startswith(("dataset", "data", "collat")):
        return "one of the data's items cannot be read or collated: check the Dataset's __getitem__ and the files"
    return ""


def user_error(task: Task, part: str, e: BaseException, fix: str = "") -> UserCodeError:
    """The one line for an exception the user's code raised in ``part``, with the fix hint."""
    hint = fix or fix_hint(part, e)
    name = task_name(task)
    if isinstance(e, NotImplementedError):
        msg = f"task {name}: {part} is not implemented"
    else:
        lines = str(e).strip().splitlines()
        # a DataLoader worker's exception carries the worker's traceback: its last line is the error
        first = (lines[-1] if "Original Traceback" in str(e) else lines[0]) if lines else ""
        first = first[:300].rstrip(".")  # the fix follows after "; "
        msg = f"task {name}: {part} failed: {type(e).__name__}{': ' + first if first else ''}"
    err = UserCodeError(msg + (f"; {hint}" if hint else ""), name, part, type(e).__name__)
    err.__cause__ = e  # kept for `-v` (the CLI prints the traceback then), never printed otherwise
    err.__suppress_context__ = True
    return err


def call_part(task: Task, part: str, fn: Callable[..., Any], *args: Any, fix: str = "") -> Any:
    """Call one part of the user's task; an exception becomes a UserCodeError naming task and part.

    Every call shoal makes into a task's code goes through here (or :func:`user_batches` for the
    data), so a user's mistake is one line in every job: simulate, the sweep, a node, a peer."""
    try:
        return fn(*args)
    except ShoalError:
        raise
    except Exception as e:
        raise user_error(task, part, e, fix) from e


def user_batches(task: Task, batches: Iterable[Any], part: str = "data (dataset[i] / collate_fn)") -> Iterator[Any]:
    """``batches`` (a DataLoader over the task's Dataset), each failure of the user's
    ``__getitem__`` or ``collate_fn`` a UserCodeError naming the data (or ``part``: any iteration
    that runs the task's code, such as the batched trainer's steps)."""
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except ShoalError:
            raise
        except Exception as e:
            raise user_error(task, part, e) from e
        yield batch


def make_model(task: Task, seed: int | None = None) -> nn.Module:
    """The task's model, initialised after ``torch.manual_seed(seed)`` (same seed, same model)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = call_part(task, "model()", task.model)
    if not isinstance(model, nn.Module):
        raise TaskError(
            f"task {task_name(task)}: model() returned a {type(model).__name__}, expected a torch.nn.Module"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise TaskError(f"task {task_name(task)}: model() has no trainable parameter (all requires_grad = False)")
    if task.optimizer is not None and task.optimizer not in OPTIMIZERS:
        raise TaskError(f"task {task_name(task)}: optimizer = {task.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    return model


def check_data(task: Task, data: Any, what: str, allow_none: bool = False) -> ClientData | None:
    """``data`` must be an (x, y) tensor pair or a non-empty map-style Dataset."""
    if data is None and allow_none:
        return None
    if isinstance(data, list) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        data = (data[0], data[1])
    if isinstance(data, tuple):
        if len(data) != 2 or not all(isinstance(t, torch.Tensor) for t in data):
            raise TaskError(f"task {task_name(task)}: {what} is a tuple of {len(data)} items; expected (x, y) tensors")
        x, y = data
        if x.shape[0] != y.shape[0]:
            raise TaskError(f"task {task_name(task)}: {what} has {x.shape[0]} inputs but {y.shape[0]} targets")
        return data
    if isinstance(data, Dataset) and hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return data
    raise TaskError(
        f"task {task_name(task)}: {what} is a {type(data).__name__}; expected an (x, y) pair of tensors "
        "or a map-style torch.utils.data.Dataset of (x, y) items or dicts of tensors with 'labels'"
    )


def check_loss(task: Task, model: nn.Module, data: ClientData, device: torch.device) -> None:
    """Run the loss on a two-example batch: it must be a finite scalar with a gradient."""
    if num_examples(data) == 0:
        return
    batch = first_batch(task, data, 2)
    x, y = split_batch(task.to_device(batch, device))
    # The check must leave no trace: BatchNorm statistics and the global RNG (dropout) are restored.
    # (the buffers only: a forward pass changes no parameter, and a large model is not copied)
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}
    rng_state = torch.random.get_rng_state()
    model.train()
    try:
        loss = call_part(
            task,
            "loss(model, x, y)",
            task.loss,
            model,
            x,
            y,
            fix="the data's items must be (x, y) pairs or dicts with 'labels' that the model and loss accept",
        )
        with torch.no_grad():
            out = forward(model, x)
        warn_if_broadcast(task, out, y)
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(saved[k])
        torch.random.set_rng_state(rng_state)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TaskError(
            f"task {task_name(task)}: loss(model, x, y) returned {shape}, expected a scalar tensor; "
            "reduce it with .mean()"
        )
    if not loss.requires_grad:
        raise TaskError(f"task {task_name(task)}: loss(model, x, y) has no gradient; compute it from model(x)")
    # No backward pass ran: gradients (possibly bound to a trainer's flat buffer) are untouched.


def warn_if_broadcast(task: Task, out: object, y: object) -> None:
    """One warning when the model's output and the targets have the same number of values but
    not the same shape, (B, 1) against (B,): a loss written as ``(model(x) - y)`` broadcasts
    them to (B, B) and trains to nothing without an error (a regression reached R² -0.01 so)."""
    if not (isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor)):
        return
    if out.shape != y.shape and out.numel() == y.numel() and out.shape[0] == y.shape[0] and out.numel() > 1:
        log.warning(
            "task %s: model(x) has shape %s and y has shape %s for a batch of %d: a loss that combines them "
            "element-wise broadcasts to %s; squeeze the output (model(x).squeeze(-1)) or reshape y",
            task_name(task),
            tuple(out.shape),
            tuple(y.shape),
            out.shape[0],
            tuple(torch.broadcast_shapes(out.shape, y.shape)) if _broadcastable(out.shape, y.shape) else "an error",
        )


def _broadcastable(a: torch.Size, b: torch.Size) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def first_batch(task: Task, data: ClientData, n: int) -> Any:
    """The first ``n`` examples of ``data`` as one batch: an (x, y) pair or a dict with 'labels'."""
    pair = as_tensors(data)
    if pair is not None:
        return pair[0][:n], pair[1][:n]
    items = [call_part(task, "dataset[i]", data.__getitem__, i) for i in range(min(n, len(data)))]  # type: ignore
    collate = task.collate_fn or torch.utils.data.default_collate
    batch = call_part(task, "collating a batch", collate, items)
    try:
        split_batch(batch)
    except ValueError as e:
        raise TaskError(
            f"task {task_name(task)}: {e}; a Dataset's items must be (x, y) pairs or dicts of tensors with "
            "'labels' (or give collate_fn that returns one of those)"
        ) from None
    return batch
