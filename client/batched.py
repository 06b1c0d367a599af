"""Many clients' local training at once: one batched forward/backward for K models.

The K clients' parameters are the rows of one (K, numel) tensor; ``torch.func``'s
``functional_call`` under ``vmap`` runs the shared architecture with each row as its
weights, so a step of K clients is a handful of batched matmuls/convolutions instead of
K Python round trips. Semantics are LocalTrainer's (client/training.py), step for step:

- each client's batches come from ``torch.randperm`` with a CPU Generator seeded by the
  client's task seed, one permutation per epoch, with the same partial last batch;
- a batch shorter than the padded width has its padded rows weighted 0 and its real
  rows 1/n, so its loss (and gradient) is the mean over the real rows only;
- clients are sorted by their number of local steps (most first), so at every step the
  clients still training are a prefix of the rows and finished clients cost nothing;
- weight decay, the FedProx term (Li et al. 2020, eq. 2) and heavy-ball momentum are the
  same vector ops as LocalTrainer._step, applied to every client's copy of each tensor.

Plain MLPs (a chain of Flatten, Linear and ReLU, found by :func:`linear_chain` with
torch.fx: logistic regression, the 2NN) trained in fp32 skip vmap and autograd: the chain
path runs the forward pass as ``baddbmm`` on (K, out, in) views of the stacked buffer and
the backward pass by hand (softmax cross-entropy, ReLU masks, ``dW = dZ^T H``). With
plain SGD the weight update is fused into the backward product
(``W.baddbmm_(dZ^T, H, alpha=-lr)``), so no gradient is ever stored; with momentum the
gradient is accumulated straight into the momentum buffer, and weight decay / FedProx
are added there, tensor by tensor while it is in cache. On a CPU this path is what makes
batching pay for the 2NN: under vmap, autograd writes each client's gradient and the
step reads it back, passes over K stacked models that no longer fit in cache
(docs/results.md, "Fast simulation").

Layers vmap cannot batch by itself (GRU, LSTM, RNN: no batching rule) or batches slowly
(attention), and with ``simulation.batched_conv = "matmul"`` Conv2d, run as the stand-ins of
client/batched_layers.py: :func:`batchable` swaps them into a copy of the model, with the same
parameter names, which is what the vmap path calls. Models with buffers (BatchNorm
statistics) or layers that draw randomness (dropout with p > 0) are not batched:
:func:`unsupported_reason` says why and the simulator trains them one by one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from shoal.config import TrainConfig
from shoal.params import Entry, ParamSpec
from shoal.update import Update

from .batched_layers import CONV_MODES, batchable, random_layers
from .step_graphs import StepRunner
from .training import autocast, matmul_precision

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BatchTerms:
    """The per-client terms of a batched round's local objective (:class:`BatchedTrainer`), one row per
    client in the order the clients were given: what ``training.Objective`` is for one client."""

    correction: torch.Tensor | None = None  # (K, numel): added to each gradient, before the momentum
    drift: torch.Tensor | None = None  # (K, numel): added to each step, after the momentum
    prox_mu: float | None = None  # replaces train.prox_mu for every client


# TrainConfig fields whose meaning BatchedTrainer reproduces. A field added later (by a
# feature that changes local training) makes the batched path step aside, unless it is
# left at its default, rather than silently ignoring it.
HANDLED_TRAIN_FIELDS = frozenset(
    {"epochs", "batch_size", "lr", "momentum", "weight_decay", "prox_mu", "device", "precision"}
)
# A CPU chunk's state should stay near the cores (L2 is 2 MiB per core on the machine
# measured): the 2NN ran fastest at 12-16 clients per chunk, logreg at 25-100, both slower
# with 100 2NN models stacked (bench/sim_throughput.py --chunks, docs/results.md).
CPU_CHUNK_BYTES = 32 << 20
# On a CPU, the vmap path pays only for small models: there sequential training is
# dominated by per-step Python overhead, which batching removes, while a larger model's
# vmapped steps were measured slower than one client at a time (docs/results.md, "Fast
# simulation"). MLPs that LinearChain handles are batched on a CPU at any size; GPUs
# batch every model.
CPU_AUTO_MAX_PARAMS = 100_000


def unsupported_reason(model: nn.Module, cfg: TrainConfig) -> str | None:
    """Why ``model`` trained with ``cfg`` cannot be batched, or None if it can."""
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        return f"the model has buffers ({', '.join(buffers[:3])}) that vmap cannot keep per client"
    norms = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)})
    if norms:
        return f"the model has {', '.join(norms)} layers (batch statistics per client)"
    random = random_layers(model)
    if random:
        return f"the model has {', '.join(random)} layers that draw random numbers per client (p > 0)"
    default = TrainConfig()
    for f in dataclasses.fields(cfg):
        if f.name not in HANDLED_TRAIN_FIELDS and getattr(cfg, f.name) != getattr(default, f.name):
            return f"train.{f.name} = {getattr(cfg, f.name)!r} is not implemented by the batched trainer"
    return None


@dataclasses.dataclass(frozen=True)
class ChainLayer:
    """One op of a :class:`LinearChain`: ``flatten``, ``relu`` or ``linear`` (with its entries)."""

    kind: str
    weight: Entry | None = None
    bias: Entry | None = None


def linear_chain(model: nn.Module, spec: ParamSpec) -> list[ChainLayer] | None:
    """The model as Flatten/Linear/ReLU ops in order, or None if it is anything else.

    torch.fx traces ``forward``; every node must take the previous node's output as its
    only input, flatten only the sample dims before the first Linear, use each Linear
    once, end with a Linear (the logits), and the Linears' tensors must be exactly the
    spec's entries. Anything fx cannot trace, or any other op, gives None (vmap path).
    """
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - any untraceable forward just takes the vmap path
        return None
    modules = dict(model.named_modules())
    entries = {e.name: e for e in spec.entries}
    layers: list[ChainLayer] = []
    used: set[str] = set()
    prev = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if prev is not None:
                return None
            prev = node
            continue
        if prev is None or node.args[:1] != (prev,) or any(a is not prev for a in node.all_input_nodes):
            return None
        if node.op == "output":
            break
        kind = None
        if node.op == "call_module":
            m = modules[node.target]
            if isinstance(m, nn.Linear) and node.target not in used:
                used.add(node.target)
                w = entries.get(f"{node.target}.weight")
                b = entries.get(f"{node.target}.bias") if m.bias is not None else None
                if w is None or (m.bias is not None and b is None):
                    return None
                layers.append(ChainLayer("linear", w, b))
                prev = node
                continue
            if isinstance(m, nn.ReLU):
                kind = "relu"
            elif isinstance(m, nn.Flatten) and m.start_dim == 1 and m.end_dim == -1:
                kind = "flatten"
        elif node.op in ("call_function", "call_method"):
            if node.target in (F.relu, torch.relu, "relu") and len(node.args) == 1:
                kind = "relu"
            elif node.target in (torch.flatten, "flatten") and tuple(node.args[1:]) == (1,) and not node.kwargs:
                kind = "flatten"
        if kind is None:
            return None
        if kind == "flatten" and any(layer.kind == "linear" for layer in layers):
            return None
        layers.append(ChainLayer(kind))
        prev = node
    linears = [layer for layer in layers if layer.kind == "linear"]
    if not linears or layers[-1].kind != "linear":
        return None
    covered = {e.name for layer in linears for e in (layer.weight, layer.bias) if e is not None}
    if covered != set(entries):
        return None
    return layers


def as_example(model: nn.Module, example: torch.Tensor | tuple[int, ...]) -> torch.Tensor:
    """A batch of one input on the model's device: ``example``'s dtype (token ids stay integers),
    or zeros of the parameters' dtype when only an input shape is given."""
    p = next(model.parameters())
    if isinstance(example, torch.Tensor):
        return torch.zeros_like(example[:1], device=p.device)
    return torch.zeros((1, *example), dtype=p.dtype, device=p.device)


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples/lists/dicts of them, as RNNs return)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def activation_floats(model: nn.Module, example: torch.Tensor | tuple[int, ...]) -> int:
    """Floats the forward pass of one sample produces (sum over leaf modules' outputs)."""
    total = 0

    def count(_m, _i, out):
        nonlocal total
        total += sum(t.numel() for t in _tensors(out))

    leaves = [m for m in model.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            model(as_example(model, example))
    finally:
        for h in hooks:
            h.remove()
    return total


def vmap_blocker(model: nn.Module, example: torch.Tensor | tuple[int, ...], conv: str = "grouped") -> str | None:
    """Why the vmap path cannot run ``model`` (None: it can), found by trying it: a forward pass of
    two stacked copies of the parameters on a zero input under ``torch.func.vmap``, with the
    stand-in layers the trainer uses (:func:`batchable`, ``conv`` as in BatchedTrainer). Layers
    left without a stand-in (an LSTM with proj_size: no batching rule for aten::lstm), outputs
    that are not one logits tensor, and any op vmap cannot batch are caught here, once, instead
    of failing in the first round."""
    x = as_example(model, example)
    params = {n: torch.stack([p.detach(), p.detach()]) for n, p in model.named_parameters()}
    swapped = batchable(model, conv).train()

    def forward(p: dict[str, torch.Tensor]) -> object:
        return functional_call(swapped, p, (x,))

    try:
        with torch.no_grad():
            out = vmap(forward)(params)
    except Exception as e:  # noqa: BLE001 - any failure means: not batchable, say why
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"the model's forward cannot run under torch.func.vmap ({type(e).__name__}: {first})"
    if not isinstance(out, torch.Tensor):
        return f"the model returns {type(out).__name__}, not one tensor of logits"
    if out.dim() != 3 or out.shape[:2] != (2, 1):
        return f"the model's output has shape {tuple(out.shape[1:])} for one example, not (1, classes)"
    return None


def clients_per_chunk(
    model: nn.Module,
    spec: ParamSpec,
    example: torch.Tensor | tuple[int, ...],
    batch_size: int,
    device: torch.device,
    budget_bytes: int | None = None,
) -> int:
    """How many clients fit in one vmapped chunk within a fixed memory budget.

    Per client: parameters, gradient and momentum (3 x numel floats) plus the
    activations of one batch kept for backward (about 3 x per sample). On a GPU the
    budget is a third of its memory; on a CPU it is CPU_CHUNK_BYTES, because there
    batching pays only while the chunk's state stays in cache. The budget is
    fixed per device, not read from free memory, so a config gives the same chunks, hence
    the same numbers, on every run.
    """
    if budget_bytes is None:
        if device.type == "cuda":
            budget_bytes = torch.cuda.get_device_properties(device).total_memory // 3
        else:
            budget_bytes = CPU_CHUNK_BYTES
    per_client = 4 * (3 * spec.numel + 3 * batch_size * activation_floats(model, example))
    return max(1, budget_bytes // max(per_client, 1))


@dataclasses.dataclass
class _ChunkTerms:
    """BatchTerms of one chunk's clients (rows in the chunk's order), prox_mu resolved."""

    correction: torch.Tensor | None
    drift: torch.Tensor | None
    prox_mu: float


class BatchedTrainer:
    """Trains up to ``max_clients`` clients at once from one global vector."""

    def __init__(
        self,
        model: nn.Module,
        spec: ParamSpec,
        cfg: TrainConfig,
        device: torch.device | str,
        max_clients: int,
        cuda_graphs: bool = True,
        conv: str = "grouped",
    ):
        reason = unsupported_reason(model, cfg)
        if reason is not None:
            raise ValueError(f"cannot batch clients: {reason}")
        if conv not in CONV_MODES:
            raise ValueError(f"cannot batch clients: batched_conv = {conv!r} is not one of {', '.join(CONV_MODES)}")
        self.model = model
        self.spec = spec
        self.cfg = cfg
        self.device = torch.device(device)
        self.max_clients = max(1, int(max_clients))
        # how a step is recorded and replayed: CUDA graphs on a GPU, None (eager) elsewhere (client/step_graphs.py)
        self.step_graphs = StepRunner.cuda_graphs(self.device, cuda_graphs)
        names = {n for n, _ in model.named_parameters()}
        missing = [e.name for e in spec.entries if e.name not in names]
        if missing:
            raise ValueError(f"cannot batch clients: spec entries {missing} are not parameters")
        self._trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        # The hand-written chain path: fp32 or tf32 (bf16 autocast stays with vmap) and
        # every tensor trainable (it has no per-entry mask for frozen ones).
        all_trainable = self._trainable == {e.name for e in spec.entries}
        self.chain = linear_chain(model, spec) if cfg.precision != "bf16" and all_trainable else None

        # What the vmap path runs: a copy with the stand-in layers (same parameter names and
        # tensors; the model itself is left as it is), in training mode as LocalTrainer puts it.
        self.batchable = batchable(model, conv).train()

        def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.batchable, params, (x,))

        self._forward = vmap(forward)
        self._terms = _ChunkTerms(None, None, cfg.prox_mu)  # the chunk being trained (train sets it)

    def train(
        self,
        global_flat: torch.Tensor,
        x_all: torch.Tensor,
        y_all: torch.Tensor,
        starts: Sequence[int],
        sizes: Sequence[int],
        seeds: Sequence[int],
        terms: BatchTerms | None = None,
    ) -> Iterator[tuple[int, Update]]:
        """Train clients whose data are ``x_all[starts[i] : starts[i] + sizes[i]]``.

        Yields ``(i, update)`` for every client i, in chunks of at most ``max_clients``,
        clients with more local steps first. ``update.base_version``/``sender`` are left
        for the caller to fill. ``x_all``/``y_all`` should live on the trainer's device.
        ``terms``: an algorithm's per-client additions to the local objective (row i for
        client i; client/algorithms.py), as LocalTrainer applies an Objective's.
        """
        steps = self.local_steps(sizes)
        order = self.order(sizes)
        global_flat = global_flat.to(self.device)
        chain = self.chain is not None and (x_all.dim() == 2 or self.chain[0].kind == "flatten")
        train_chunk = self._train_chunk_chain if chain else self._train_chunk
        for c in range(0, len(order), self.max_clients):
            chunk = order[c : c + self.max_clients]
            self._terms = self._chunk_terms(terms, chunk)
            with matmul_precision(self.device, self.cfg.precision):
                deltas, losses = train_chunk(
                    global_flat,
                    x_all,
                    y_all,
                    [starts[i] for i in chunk],
                    [sizes[i] for i in chunk],
                    [seeds[i] for i in chunk],
                    [steps[i] for i in chunk],
                )
            for j, i in enumerate(chunk):
                metrics = {"train_loss": float(losses[j]) / max(steps[i], 1), "local_steps": float(steps[i])}
                yield i, Update(delta=deltas[j], num_examples=int(sizes[i]), metrics=metrics)

    def _chunk_terms(self, terms: BatchTerms | None, chunk: list[int]) -> _ChunkTerms:
        """The rows of ``terms`` for the clients of ``chunk``, in the chunk's order, on the device."""
        mu = self.cfg.prox_mu if terms is None or terms.prox_mu is None else terms.prox_mu
        if terms is None:
            return _ChunkTerms(None, None, mu)
        index = torch.tensor(chunk, device=self.device)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device).index_select(0, index)

        return _ChunkTerms(rows(terms.correction), rows(terms.drift), mu)

    def local_steps(self, sizes: Sequence[int]) -> list[int]:
        """Each client's number of local steps (epochs x batches)."""
        return [self.cfg.epochs * -(-n // self.cfg.batch(n)) if n else 0 for n in sizes]

    def order(self, sizes: Sequence[int]) -> list[int]:
        """The order :meth:`train` yields clients of these sizes in: most local steps first, then
        as given (a pool training them elsewhere hands results on in the same order)."""
        steps = self.local_steps(sizes)
        return sorted(range(len(sizes)), key=lambda i: (-steps[i], i))

    def _batch_plan(self, starts, sizes, seeds, steps) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices into the data (K, T, B) and per-row loss weights (K, T, B).

        Built on the CPU with the same Generator calls as LocalTrainer, then moved to the
        device once per chunk; padded rows point at a real row and weigh 0.
        """
        cfg = self.cfg
        width = max((cfg.batch(n) for n in sizes if n), default=1)
        total = max(steps, default=0)
        rows = torch.zeros((len(sizes), total, width), dtype=torch.long)
        weights = torch.zeros((len(sizes), total, width), dtype=torch.float32)
        for k, (start, n, seed) in enumerate(zip(starts, sizes, seeds)):
            if n == 0:
                continue
            bs = cfg.batch(n)
            per_epoch = -(-n // bs)
            gen = torch.Generator().manual_seed(int(seed) % (1 << 63))
            for e in range(cfg.epochs):
                perm = torch.randperm(n, generator=gen)
                padded = torch.full((per_epoch * bs,), -1, dtype=torch.long)
                padded[:n] = perm
                block = padded.view(per_epoch, bs)
                real = block >= 0
                counts = real.sum(1, keepdim=True).float()
                t = slice(e * per_epoch, (e + 1) * per_epoch)
                rows[k, t, :bs] = int(start) + block.clamp(min=0)
                rows[k, t, bs:] = int(start)
                weights[k, t, :bs] = real.float() / counts
        return rows.to(self.device), weights.to(self.device)

    def _train_chunk(self, global_flat, x_all, y_all, starts, sizes, seeds, steps):
        cfg, spec = self.cfg, self.spec
        k = len(sizes)
        rows, weights = self._batch_plan(starts, sizes, seeds, steps)
        params = global_flat.unsqueeze(0).repeat(k, 1)
        momentum = torch.zeros_like(params) if cfg.momentum > 0 else None
        loss_sum = torch.zeros(k, device=self.device)
        clock = torch.zeros(1, dtype=torch.long, device=self.device)  # the step, read and moved on the device

        def step(a: int) -> None:
            # One leaf per tensor (views of the first a rows): autograd returns each
            # gradient once, and the step below works on the same views in place.
            p = [self._rows(params, e, a).detach().requires_grad_(e.name in self._trainable) for e in spec.entries]
            idx, wb = self._batch_at(rows, weights, clock, a)
            xb, yb = x_all[idx], y_all[idx]
            with autocast(self.device, cfg.precision, cache=False):
                logits = self._forward({e.name: v for e, v in zip(spec.entries, p)}, xb)
            ce = F.cross_entropy(logits.flatten(0, 1).float(), yb.flatten(), reduction="none").view_as(wb)
            loss = (ce * wb).sum(1)
            train = [(e, v) for e, v in zip(spec.entries, p) if v.requires_grad]
            grads = torch.autograd.grad(loss.sum(), [v for _, v in train])
            with torch.no_grad():
                for (e, _), grad in zip(train, grads):
                    self._step(
                        self._rows(params, e, a),
                        grad,
                        None if momentum is None else self._rows(momentum, e, a),
                        self._rows(global_flat.unsqueeze(0), e, 1),
                        e,
                        a,
                    )
                loss_sum[:a] += loss.detach()
                clock.add_(1)

        self._run_steps(step, steps)
        deltas = params - global_flat
        return deltas, loss_sum.cpu()

    def _run_steps(self, step, steps: Sequence[int]) -> None:
        """``step(a)`` for every local step of the chunk, ``a`` the clients still training (they are
        sorted by steps, most first, so they are a prefix of the rows), as CUDA graph replays where
        they can be (client/step_graphs.py)."""
        runner = StepRunner(self.step_graphs, self.device)
        runner.run(step, [sum(1 for s in steps if s > t) for t in range(max(steps, default=0))])
        if runner.failed:
            self.step_graphs = None

    @staticmethod
    def _batch_at(rows: torch.Tensor, weights: torch.Tensor, clock: torch.Tensor, a: int):
        """The batch of step ``clock`` for the first ``a`` clients: row indices and loss weights (a, B),
        selected on the device so that a recorded step picks the next batch at each replay."""
        return rows[:a].index_select(1, clock).squeeze(1), weights[:a].index_select(1, clock).squeeze(1)

    def _train_chunk_chain(self, global_flat, x_all, y_all, starts, sizes, seeds, steps):
        """_train_chunk for a Flatten/Linear/ReLU chain: batched matmuls, backward by hand.

        Per step, for the ``a`` clients still training: Z = H W^T + b per Linear as one
        ``baddbmm`` over (a, out, in) views of the stacked parameters (a layout with each
        tensor's K copies contiguous was measured no faster); the loss gradient
        of the weighted softmax cross-entropy is ``w (softmax(Z) - onehot(y))``; going
        back, ``dH = dZ W`` (before W changes), ``dW = dZ^T H``, ``db = sum_rows dZ`` and
        ReLU passes dZ where its output was positive.
        """
        cfg, chain = self.cfg, self.chain
        k = len(sizes)
        rows, weights = self._batch_plan(starts, sizes, seeds, steps)
        params = global_flat.unsqueeze(0).repeat(k, 1)
        terms = self._terms
        fused = not (cfg.momentum or cfg.weight_decay or terms.prox_mu or terms.correction is not None)
        fused = fused and terms.drift is None
        # the momentum buffer, or (momentum 0) scratch for the gradient plus its extra terms
        state = None if fused else torch.zeros_like(params)
        loss_sum = torch.zeros(k, device=self.device)
        x_flat = x_all.flatten(1)
        first_linear = next(i for i, layer in enumerate(chain) if layer.kind == "linear")
        clock = torch.zeros(1, dtype=torch.long, device=self.device)  # the step, read and moved on the device

        def step(a: int) -> None:
            idx, wb = self._batch_at(rows, weights, clock, a)
            h, yb = x_flat[idx], y_all[idx]
            tape = []  # per layer: a Linear's input, a ReLU's output
            for layer in chain:
                if layer.kind == "linear":
                    tape.append(h)
                    wt = self._rows(params, layer.weight, a).transpose(1, 2)
                    if layer.bias is None:
                        h = torch.bmm(h, wt)
                    else:
                        h = torch.baddbmm(self._rows(params, layer.bias, a).unsqueeze(1), h, wt)
                elif layer.kind == "relu":
                    h = torch.relu(h)
                    tape.append(h)
                else:  # flatten: x_flat already is
                    tape.append(None)
            logp = torch.log_softmax(h, -1)
            loss_sum[:a] -= (logp.gather(-1, yb.unsqueeze(-1)).squeeze(-1) * wb).sum(1)
            d = logp.exp_()
            d.scatter_add_(-1, yb.unsqueeze(-1), torch.full((*yb.shape, 1), -1.0, dtype=d.dtype, device=d.device))
            d.mul_(wb.unsqueeze(-1))
            for i in range(len(chain) - 1, first_linear - 1, -1):
                layer, saved = chain[i], tape[i]
                if layer.kind == "relu":
                    d = d * (saved > 0)
                    continue
                if layer.kind != "linear":
                    continue
                w = self._rows(params, layer.weight, a)
                d_in = torch.bmm(d, w) if i > first_linear else None
                d_t = d.transpose(1, 2)
                if fused:  # plain SGD: W <- W - lr dZ^T H in one product, no gradient stored
                    w.baddbmm_(d_t, saved, alpha=-cfg.lr)
                    if layer.bias is not None:
                        self._rows(params, layer.bias, a).add_(d.sum(1), alpha=-cfg.lr)
                else:
                    self._chain_step(
                        params,
                        state,
                        global_flat,
                        layer.weight,
                        a,
                        lambda buf, beta: buf.baddbmm_(d_t, saved, beta=beta),
                    )
                    if layer.bias is not None:
                        self._chain_step(
                            params,
                            state,
                            global_flat,
                            layer.bias,
                            a,
                            lambda buf, beta: buf.mul_(beta).add_(d.sum(1)) if beta else torch.sum(d, 1, out=buf),
                        )
                if d_in is None:  # the first Linear: nothing before it learns
                    break
                d = d_in
            clock.add_(1)

        self._run_steps(step, steps)
        return params - global_flat, loss_sum.cpu()

    def _chain_step(self, params, state, global_flat, e, a: int, accumulate) -> None:
        """LocalTrainer._step for tensor ``e`` of the first ``a`` clients, gradient fused in.

        ``accumulate(buf, beta)`` writes ``beta * buf + dE/dW`` into ``buf`` (one
        ``baddbmm_``), so with momentum the gradient goes straight into the momentum
        buffer (m = beta m + g); weight decay and the FedProx term (Li et al. 2020, eq. 2)
        are added to it, then W <- W - lr buf, while the tensor is still in cache.
        """
        cfg, terms = self.cfg, self._terms
        w, buf = self._rows(params, e, a), self._rows(state, e, a)
        accumulate(buf, cfg.momentum)
        if terms.correction is not None:  # an algorithm's gradient correction (FedDyn's -grad_k)
            buf.add_(self._rows(terms.correction, e, a))
        mu = terms.prox_mu
        if cfg.weight_decay or mu:  # + wd W + mu (W - W_global), without a temporary
            buf.add_(w, alpha=cfg.weight_decay + mu)
        if mu:
            buf.sub_(self._rows(global_flat.unsqueeze(0), e, 1), alpha=mu)
        w.add_(buf, alpha=-cfg.lr)
        if terms.drift is not None:  # after the momentum: SCAFFOLD's c - c_i
            w.add_(self._rows(terms.drift, e, a), alpha=-cfg.lr)

    @staticmethod
    def _rows(flat: torch.Tensor, e, a: int) -> torch.Tensor:
        """The first ``a`` rows of tensor ``e`` in a (K, numel) buffer, shaped (a, *shape)."""
        return flat[:a, e.offset : e.offset + e.numel].view(a, *e.shape)

    def _step(
        self, w: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor | None, w_global: torch.Tensor, e, a: int
    ) -> None:
        """LocalTrainer._step for one trainable tensor ``e`` of the first ``a`` rows (in place on
        w/momentum), with the chunk's algorithm terms where LocalTrainer._run adds an Objective's.

        Frozen tensors get no step at all, as in LocalTrainer (their gradient is zero and
        weight decay / the proximal term are masked to trainable entries).
        """
        cfg, terms = self.cfg, self._terms
        if terms.correction is not None:
            grad.add_(self._rows(terms.correction, e, a))
        if cfg.weight_decay:
            grad.add_(w, alpha=cfg.weight_decay)
        if terms.prox_mu:  # FedProx: gradient of (mu/2)||w - w_global||^2
            grad.add_(w - w_global, alpha=terms.prox_mu)
        step = grad
        if momentum is not None:
            step = momentum.mul_(cfg.momentum).add_(grad)
        w.add_(step, alpha=-cfg.lr)
        if terms.drift is not None:
            w.add_(self._rows(terms.drift, e, a), alpha=-cfg.lr)


def make_batched_trainer(
    setting: int | str,
    model: nn.Module,
    spec: ParamSpec,
    cfg: TrainConfig,
    device: torch.device,
    example: torch.Tensor | tuple[int, ...],
    clients_per_round: int,
    max_client_size: int,
    cuda_graphs: bool = True,
    conv: str = "grouped",
) -> BatchedTrainer | None:
    """``simulation.batch_clients`` -> a BatchedTrainer, or None to train one by one.

    ``auto`` batches every round's clients that fit the memory budget of
    :func:`clients_per_chunk` (on a CPU only Linear/ReLU chains, any size, and other
    models up to CPU_AUTO_MAX_PARAMS); an
    integer N trains N at once as asked (1 = sequential; the memory is then the user's call). A model
    or option that cannot be batched falls back to sequential and says why, once. ``example`` is
    one input (a batch of one, with the data's dtype), or just its shape. ``conv``:
    ``simulation.batched_conv``, how the vmap path runs Conv2d layers.
    """
    if setting == 1 or clients_per_round <= 1:
        return None
    reason = unsupported_reason(model, cfg)
    chain = reason is None and cfg.precision != "bf16" and linear_chain(model, spec) is not None
    if reason is None and not chain:
        reason = vmap_blocker(model, example, conv)
    if reason is not None:
        level = logging.INFO if setting == "auto" else logging.WARNING
        log.log(level, "simulation.batch_clients = %r: training clients one by one because %s", setting, reason)
        return None
    if setting == "auto" and device.type == "cpu" and not chain and spec.numel > CPU_AUTO_MAX_PARAMS:
        log.info(
            "simulation.batch_clients = 'auto': training clients one by one on the CPU because the model is "
            "not a Linear/ReLU chain and has %d > %d parameters (set an integer to batch anyway)",
            spec.numel,
            CPU_AUTO_MAX_PARAMS,
        )
        return None
    fit = clients_per_chunk(model, spec, example, cfg.batch(max(max_client_size, 1)), device)
    n = min(clients_per_round, fit if setting == "auto" else int(setting))
    if n <= 1:
        log.info(
            "simulation.batch_clients = %r: one client per chunk fits the memory budget; training one by one", setting
        )
        return None
    trainer = BatchedTrainer(model, spec, cfg, device, n, cuda_graphs, conv=conv)
    log.info("training up to %d clients at once (%s) on %s", n, "Linear chain" if trainer.chain else "vmap", device)
    return trainer
