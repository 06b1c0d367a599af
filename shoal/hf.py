"""Hugging Face language models as shoal tasks: a local base model, PEFT adapters on the wire.

:class:`HFTask` builds a causal-LM or sequence-classification model from a local config (a
dict, a ``config.json`` file, a folder holding only ``config.json``) or a local checkpoint
folder (``from_pretrained(path, local_files_only=True)``: shoal never downloads a model),
then applies a PEFT config (LoRA). PEFT freezes the base and marks the adapters (and any
``modules_to_save``, such as a classification head) trainable; shoal exchanges exactly the
trainable tensors (shoal/params.py), so every update on the wire holds the adapters alone and
the base never leaves a node.

Batches are dicts of tensors (``input_ids``, ``attention_mask``, ``labels``), made by the
task's own tokenizer, Dataset and collate function (:func:`pad_collate` pads to the longest
sequence); the model is called as ``model(**batch)`` and its own loss is the training loss.
Evaluation reports the loss per token (causal LM: every position whose label is not
``IGNORE_INDEX``), perplexity = exp(loss) and next-token accuracy; for classification the
loss, perplexity and accuracy per example.

Subclass :class:`HFTask` and give the data (``simulation_data``, ``local_data``), as for any
task; docs/tasks.md "Language models" has a complete example. Needs ``pip install 'shoal[hf]'``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .task import Task, TaskError, logits_of

log = logging.getLogger(__name__)

KINDS = ("causal-lm", "sequence-classification")
IGNORE_INDEX = -100  # a label that no loss or metric counts (padding), as Hugging Face models use
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _libraries() -> tuple[Any, Any]:
    try:
        import peft
        import transformers
    except ImportError as e:
        raise TaskError(f"shoal.hf needs transformers and peft: pip install 'shoal[hf]' ({e})") from None
    return transformers, peft


def _auto_class(transformers: Any, kind: str) -> Any:
    if kind == "causal-lm":
        return transformers.AutoModelForCausalLM
    if kind == "sequence-classification":
        return transformers.AutoModelForSequenceClassification
    raise TaskError(f"shoal.hf: kind = {kind!r} is not one of {', '.join(KINDS)}")


def is_checkpoint(path: Path) -> bool:
    """A folder with a config and weights (``save_pretrained``'s layout)."""
    return path.is_dir() and (path / "config.json").is_file() and any((path / f).is_file() for f in _WEIGHT_FILES)


def load_config(source: Mapping[str, Any] | str | Path, overrides: Mapping[str, Any] | None = None) -> Any:
    """A transformers config from a dict (with ``model_type``), a ``config.json`` file or a
    folder holding one; ``overrides`` set fields on it (e.g. ``num_labels``, dropout)."""
    transformers, _ = _libraries()
    if isinstance(source, Mapping):
        fields = dict(source)
    else:
        path = Path(source).expanduser()
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise TaskError(
                f"shoal.hf: no model config at {str(path)!r} (give a config dict, a config.json or its folder)"
            )
        try:
            fields = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TaskError(f"shoal.hf: cannot read {file} as a JSON config: {e}") from None
        if not isinstance(fields, dict):
            raise TaskError(f"shoal.hf: {file} holds a {type(fields).__name__}, not a config object")
    fields.update(overrides or {})
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise TaskError('shoal.hf: the model config has no \'model_type\' (e.g. "gpt2", "llama", "bert")')
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as e:
        raise TaskError(f"shoal.hf: model config of type {model_type!r} is not valid: {e}") from None


def build_base(
    source: Mapping[str, Any] | str | Path, kind: str = "causal-lm", overrides: Mapping[str, Any] | None = None
) -> nn.Module:
    """The base model: pretrained weights from a local checkpoint folder, or freshly
    initialised from a config (from torch's global RNG: shoal seeds it before ``model()``,
    so every node builds the same one). A path that does not exist is an error, never a
    download: a hub name such as ``"gpt2"`` must be downloaded by its user first."""
    transformers, _ = _libraries()
    auto = _auto_class(transformers, kind)
    if not isinstance(source, Mapping):
        path = Path(source).expanduser()
        if not path.exists():
            raise TaskError(
                f"shoal.hf: model {str(source)!r} is not a local file or folder; shoal never downloads "
                "models: save or download the checkpoint to a folder (save_pretrained) and give its path"
            )
        if is_checkpoint(path):
            try:
                return auto.from_pretrained(str(path), local_files_only=True, **dict(overrides or {}))
            except (OSError, ValueError, TypeError, RuntimeError) as e:
                raise TaskError(f"shoal.hf: cannot load the checkpoint in {path}: {type(e).__name__}: {e}") from None
    config = load_config(source, overrides)
    try:
        return auto.from_config(config)
    except (ValueError, TypeError, KeyError) as e:
        raise TaskError(f"shoal.hf: cannot build a {kind} model from config {config.model_type!r}: {e}") from None


def make_peft_config(peft_config: Any, kind: str) -> Any:
    """A PEFT config: one given as is, or a LoRA config from a dict of ``LoraConfig`` fields."""
    _, peft = _libraries()
    if isinstance(peft_config, peft.PeftConfig):
        return peft_config
    if not isinstance(peft_config, Mapping):
        raise TaskError(
            f"shoal.hf: peft is a {type(peft_config).__name__}; give a peft config or a dict of LoRA fields"
        )
    fields = dict(peft_config)
    fields.setdefault("task_type", "CAUSAL_LM" if kind == "causal-lm" else "SEQ_CLS")
    try:
        return peft.LoraConfig(**fields)
    except (TypeError, ValueError) as e:
        raise TaskError(f"shoal.hf: LoRA config {fields} is not valid: {e}") from None


class HFTask(Task):
    """A Hugging Face causal-LM or sequence-classification model, fine-tuned with PEFT adapters.

    ``base``: a local checkpoint folder, a ``config.json`` (or its folder) or a config dict;
    ``kind``: ``"causal-lm"`` or ``"sequence-classification"``; ``peft``: a PEFT config or a dict
    of ``LoraConfig`` fields (``{"r": 8, "lora_alpha": 16, "target_modules": ["c_attn"]}``), or
    None to train (and exchange) the whole model; ``config_overrides``: config fields set on
    the base (``num_labels``, ``pad_token_id``, dropout...).

    Subclasses give the data as dict examples (a :class:`shoal.task.DictDataset` of token ids
    is the simplest), and may set ``collate_fn`` (e.g. ``pad_collate(pad_id)``), ``optimizer``.
    """

    def __init__(
        self,
        base: Mapping[str, Any] | str | Path,
        kind: str = "causal-lm",
        peft: Any = None,
        config_overrides: Mapping[str, Any] | None = None,
    ):
        if kind not in KINDS:
            raise TaskError(f"shoal.hf: kind = {kind!r} is not one of {', '.join(KINDS)}")
        self.base, self.kind, self.peft = base, kind, peft
        self.config_overrides = dict(config_overrides or {})

    def model(self) -> nn.Module:
        model = build_base(self.base, self.kind, self.config_overrides)
        if self.peft is None:
            log.warning("shoal.hf: no peft config: the whole model (%d parameters) trains and travels", _count(model))
            return model
        _, peft = _libraries()
        try:
            wrapped = peft.get_peft_model(model, make_peft_config(self.peft, self.kind))
        except (ValueError, TypeError, KeyError) as e:
            raise TaskError(f"shoal.hf: applying the PEFT config failed: {e}") from None
        trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        log.info(
            "shoal.hf: %d trainable adapter parameters on a frozen base of %d", trainable, _count(wrapped) - trainable
        )
        return wrapped

    def inputs(self, x: Any, y: torch.Tensor) -> dict[str, Any]:
        """A batch's model inputs: a dict batch as it is; a tensor of token ids with its labels."""
        if isinstance(x, Mapping):
            return dict(x)
        return {"input_ids": x, "labels": y}

    def loss(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        out = model(**self.inputs(x, y))
        loss = getattr(out, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise TaskError("shoal.hf: the model returned no loss; the batch must carry 'labels'")
        return loss

    def metrics(self, model: nn.Module, x: Any, y: torch.Tensor) -> dict[str, torch.Tensor | float]:
        """Sums per example (shoal weights batch means by examples), so that :meth:`summarize`
        divides the totals: the loss per token, exact whatever the padding."""
        batch = self.inputs(x, y)
        logits = logits_of(model(**batch)).float()
        labels = batch["labels"]
        n = labels.shape[0]
        if self.kind == "causal-lm":
            logits, labels = logits[:, :-1], labels[:, 1:]  # position t predicts token t + 1
        counted = labels != IGNORE_INDEX
        nll = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        correct = ((logits.argmax(-1) == labels) & counted).sum()
        return {
            "nll_sum": nll.double() / n,
            "tokens": counted.sum().double() / n,
            "correct": correct.double() / n,
        }

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        if "nll_sum" not in means:
            return means
        tokens = max(means["tokens"], 1e-12)
        loss = means["nll_sum"] / tokens
        out = {k: v for k, v in means.items() if k not in ("nll_sum", "tokens", "correct")}
        return {**out, "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": means["correct"] / tokens}


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def pad_collate(pad_id: int, keys: Sequence[str] = ("input_ids", "attention_mask", "labels")) -> Callable:
    """A collate function for dict examples of different lengths: right-pads ``input_ids`` with
    ``pad_id``, ``attention_mask`` with 0 and ``labels`` with :data:`IGNORE_INDEX` (so padding
    counts in no loss or metric) to the longest sequence of the batch; 0-d values (a class label)
    are stacked."""
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}

    def collate(items: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key in items[0]:
            values = [torch.as_tensor(item[key]) for item in items]
            if values[0].dim() == 0:
                out[key] = torch.stack(values)
                continue
            length = max(v.shape[0] for v in values)
            padded = torch.full((len(values), length), fill.get(key, 0), dtype=values[0].dtype)
            for i, v in enumerate(values):
                padded[i, : v.shape[0]] = v
            out[key] = padded
        missing = [k for k in keys if k not in out and k != "attention_mask"]
        if missing:
            raise ValueError(f"pad_collate: examples lack {', '.join(missing)}")
        return out

    return collate
