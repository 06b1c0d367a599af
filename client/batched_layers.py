"""Stand-ins that let ``torch.func.vmap`` batch layers it cannot batch (well) by itself.

The batched trainer (client/batched.py) runs K clients' copies of one model with
``functional_call`` under ``vmap``. Some layers stop that or make it slow:

- ``nn.GRU`` / ``nn.LSTM`` / ``nn.RNN`` call fused kernels (aten::gru, aten::lstm) that have no
  batching rule, so vmap refuses them; the stand-ins are the same recurrences written as a time
  loop of matmuls: the input projection of every time step in one product, then ``h W_hh^T``
  per step, each a batched matmul over the K clients.
- ``nn.MultiheadAttention`` reaches ``scaled_dot_product_attention``, whose CPU kernel has no
  batching rule: vmap runs it client by client (its "performance drop" warning). The stand-in
  computes softmax(Q K^T / sqrt(d)) V with matmuls.
- ``nn.Conv2d`` with per-client weights becomes a grouped convolution under vmap. With
  ``simulation.batched_conv = "matmul"`` the stand-in computes it as im2col (``F.unfold``) and
  one matmul, a ``bmm`` over the clients under vmap (tensor cores on a GPU).

A stand-in is a subclass of the layer with only ``forward`` replaced: same parameter names, same
attributes, same values, so ``functional_call`` takes the trainer's (K, numel) rows unchanged.
:func:`batchable` returns a copy of the model with the layers it can reproduce exactly swapped
(the copy shares the user's parameter tensors and never changes the user's modules). Layers it
cannot reproduce exactly (dropout between recurrent layers, LSTM ``proj_size``, attention with
``bias_k``/``add_zero_attn``, padded convolutions other than zeros) are left as they are, so
the trainer's vmap check still fails on them and says why.
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

ConvMode = Literal["grouped", "matmul"]
CONV_MODES: tuple[str, ...] = ("grouped", "matmul")


def _packed(input: object) -> None:
    if isinstance(input, PackedSequence):
        raise NotImplementedError("a PackedSequence input to a recurrent layer cannot be batched over clients")


class _RecurrentLoop:
    """The time loop shared by the recurrent stand-ins (mixed into a subclass of nn.RNNBase)."""

    def _run(self, input: torch.Tensor, hx: tuple[torch.Tensor, ...] | None, cell, n_state: int):
        """Run every layer and direction; ``cell(gi_t, gh_t, state) -> state`` is one step given
        the input projection ``gi_t`` and the recurrent projection ``gh_t`` of the state's h.

        Returns the last layer's output (in the input's layout) and the final states, each
        (layers * directions, N, H), unbatched inputs squeezed as torch does."""
        m: nn.RNNBase = self  # type: ignore[assignment]
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if batched and m.batch_first:
            x = x.transpose(0, 1)  # time-major from here on: (L, N, features)
        steps, n = x.shape[0], x.shape[1]
        dirs = 2 if m.bidirectional else 1
        if hx is None:
            zeros = torch.zeros(m.num_layers * dirs, n, m.hidden_size, dtype=x.dtype, device=x.device)
            hx = tuple(zeros for _ in range(n_state))
        elif not batched:
            hx = tuple(h.unsqueeze(1) for h in hx)
        finals: list[list[torch.Tensor]] = [[] for _ in range(n_state)]
        for layer in range(m.num_layers):
            outs = []
            for d in range(dirs):
                sfx = f"l{layer}{'_reverse' if d else ''}"
                gi = F.linear(x, getattr(m, f"weight_ih_{sfx}"), getattr(m, f"bias_ih_{sfx}") if m.bias else None)
                # one unbind, not gi[t] per step: each indexing's backward writes a gi-sized zero tensor
                per_time = gi.unbind(0)
                w_hh = getattr(m, f"weight_hh_{sfx}")
                b_hh = getattr(m, f"bias_hh_{sfx}") if m.bias else None
                state = tuple(h[layer * dirs + d] for h in hx)
                per_step: list[torch.Tensor] = [torch.empty(0)] * steps
                for t in reversed(range(steps)) if d else range(steps):
                    state = cell(per_time[t], F.linear(state[0], w_hh, b_hh), state)
                    per_step[t] = state[0]
                outs.append(torch.stack(per_step))
                for i, s in enumerate(state):
                    finals[i].append(s)
            x = outs[0] if dirs == 1 else torch.cat(outs, -1)
        out = x.transpose(0, 1) if batched and m.batch_first else x
        states = [torch.stack(f) for f in finals]
        if not batched:
            out, states = out.squeeze(1), [s.squeeze(1) for s in states]
        return out, states


class BatchableGRU(_RecurrentLoop, nn.GRU):
    """nn.GRU as a time loop of matmuls (torch's equations and gate order r, z, n)."""

    def forward(self, input, hx=None):
        _packed(input)

        sizes = [2 * self.hidden_size, self.hidden_size]

        def cell(gi, gh, state):  # r and z in one sigmoid: fewer ops per step, each one batched
            h = state[0]
            (gi_rz, gi_n), (gh_rz, gh_n) = gi.split(sizes, -1), gh.split(sizes, -1)
            r, z = torch.sigmoid(gi_rz + gh_rz).chunk(2, -1)
            new = torch.tanh(gi_n + r * gh_n)
            return (new + z * (h - new),)

        out, (h_n,) = self._run(input, None if hx is None else (hx,), cell, 1)
        return out, h_n


class BatchableLSTM(_RecurrentLoop, nn.LSTM):
    """nn.LSTM (without proj_size) as a time loop of matmuls (gate order i, f, g, o)."""

    def forward(self, input, hx=None):
        _packed(input)

        def cell(gi, gh, state):
            c = state[1]
            i, f, g, o = (gi + gh).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c), c

        out, (h_n, c_n) = self._run(input, hx, cell, 2)
        return out, (h_n, c_n)


class BatchableRNN(_RecurrentLoop, nn.RNN):
    """nn.RNN (tanh or relu) as a time loop of matmuls."""

    def forward(self, input, hx=None):
        _packed(input)
        act = torch.tanh if self.nonlinearity == "tanh" else torch.relu

        def cell(gi, gh, state):
            return (act(gi + gh),)

        out, (h_n,) = self._run(input, None if hx is None else (hx,), cell, 1)
        return out, h_n


class BatchableMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention (no dropout, bias_k/bias_v or add_zero_attn) with explicit matmuls:
    what F.multi_head_attention_forward computes, without scaled_dot_product_attention."""

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        batched = query.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        q, k, v = (t if batched else t.unsqueeze(batch_dim) for t in (query, key, value))
        if not self.batch_first:  # (N, L, E) from here on
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        e, heads = self.embed_dim, self.num_heads
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        n, tgt, src = q.shape[0], q.shape[1], k.shape[1]
        hd = e // heads
        q = F.linear(q, w_q, b_q).view(n, tgt, heads, hd).transpose(1, 2)
        k = F.linear(k, w_k, b_k).view(n, src, heads, hd).transpose(1, 2)
        v = F.linear(v, w_v, b_v).view(n, src, heads, hd).transpose(1, 2)
        scores = (q * (1.0 / math.sqrt(hd))) @ k.transpose(-2, -1)  # (N, heads, L, S)
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(tgt, src, dtype=torch.bool, device=q.device).triu(1)
        for mask in (attn_mask, key_padding_mask):
            if mask is None:
                continue
            if mask is key_padding_mask:
                mask = mask.view(n, 1, 1, src) if batched else mask.view(1, 1, 1, src)
            elif mask.dim() == 3:
                mask = mask.view(n, heads, tgt, src)
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(mask, float("-inf"))
            else:
                scores = scores + mask
        attn = torch.softmax(scores, -1)
        out = (attn @ v).transpose(1, 2).reshape(n, tgt, e)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        if not self.batch_first:
            out = out.transpose(0, 1)
        weights = (attn.mean(1) if average_attn_weights else attn) if need_weights else None
        if not batched:
            out = out.squeeze(batch_dim)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights


class MatmulConv2d(nn.Conv2d):
    """nn.Conv2d (zeros padding, groups = 1) as im2col and one matmul: under vmap the matmul is a
    bmm over the clients, where a convolution with per-client weights is a grouped convolution."""

    def forward(self, input):
        x = input if input.dim() == 4 else input.unsqueeze(0)
        kh, kw = self.kernel_size
        if isinstance(self.padding, str):
            pad = (0, 0)
            if self.padding == "same":  # torch's split: the extra row/column at the end
                th, tw = (d * (k - 1) for d, k in zip(self.dilation, self.kernel_size))
                x = F.pad(x, (tw // 2, tw - tw // 2, th // 2, th - th // 2))
        else:
            pad = tuple(self.padding)
        h, w = x.shape[-2:]
        oh, ow = (
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, p, d, k, s in zip((h, w), pad, self.dilation, (kh, kw), self.stride)
        )
        cols = F.unfold(x, (kh, kw), dilation=self.dilation, padding=pad, stride=self.stride)  # (N, C k k, L)
        # the weight on the left: the output (N, out, L) is already the image layout, and the gradient
        # of cols (W^T dY) comes out in unfold's layout, so neither pass copies a transposed tensor
        y = self.weight.flatten(1) @ cols
        if self.bias is not None:
            y = y + self.bias.unsqueeze(-1)
        y = y.view(x.shape[0], self.out_channels, oh, ow)
        return y if input.dim() == 4 else y.squeeze(0)


def stand_in(module: nn.Module, conv: str = "grouped") -> type[nn.Module] | None:
    """The stand-in class for ``module``, or None where it stays as it is (not a layer vmap needs
    help with, a subclass with its own forward, or options the stand-in does not reproduce)."""
    kind = type(module)
    if kind is nn.GRU or kind is nn.LSTM or kind is nn.RNN:
        assert isinstance(module, nn.RNNBase)
        if module.dropout and module.num_layers > 1:  # random masks between layers
            return None
        if isinstance(module, nn.LSTM) and module.proj_size:
            return None
        return {nn.GRU: BatchableGRU, nn.LSTM: BatchableLSTM, nn.RNN: BatchableRNN}[kind]
    if kind is nn.MultiheadAttention:
        assert isinstance(module, nn.MultiheadAttention)
        if module.dropout or module.bias_k is not None or module.add_zero_attn:
            return None
        return BatchableMultiheadAttention
    if kind is nn.Conv2d and conv == "matmul":
        assert isinstance(module, nn.Conv2d)
        if module.groups != 1 or module.padding_mode != "zeros":
            return None
        return MatmulConv2d
    return None


def batchable(model: nn.Module, conv: str = "grouped") -> nn.Module:
    """A copy of ``model`` with every layer :func:`stand_in` knows swapped for its stand-in.

    The copy's modules are new objects but its parameters and buffers are the model's own
    tensors (nothing is duplicated, frozen tensors follow the model); the model itself is not
    changed. ``conv``: ``"matmul"`` also swaps Conv2d for :class:`MatmulConv2d`.
    """
    if conv not in CONV_MODES:
        raise ValueError(f"batched_conv = {conv!r} is not one of {', '.join(CONV_MODES)}")
    memo: dict[int, object] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    clone = copy.deepcopy(model, memo)
    for module in clone.modules():
        kind = stand_in(module, conv)
        if kind is not None:
            module.__class__ = kind
    return clone


def random_layers(model: nn.Module) -> list[str]:
    """Names of the layer types in ``model`` that draw random numbers while training (dropout with
    p > 0, in a Dropout module, attention or between recurrent layers): per-client randomness
    that the batched trainer cannot reproduce."""
    found: set[str] = set()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            found.add(type(m).__name__)
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            found.add(f"{type(m).__name__}(dropout={m.dropout})")
        elif isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1:
            found.add(f"{type(m).__name__}(dropout={m.dropout})")
    return sorted(found)
