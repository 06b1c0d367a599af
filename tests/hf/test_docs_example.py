"""The task of docs/tasks.md "Language models", copied from the page: it loads a local
checkpoint folder, reads a node's text folder, trains its LoRA adapters and evaluates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shoal.client.training import LocalTrainer  # noqa: E402 - after the skips
from shoal.config import TrainConfig  # noqa: E402
from shoal.hf import build_base  # noqa: E402
from shoal.params import ParamSpec  # noqa: E402
from shoal.task import load_task, make_model  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "tasks.md"
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20


def doc_task() -> str:
    blocks = re.findall(r"```python\n(# my_lm_task\.py.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/tasks.md has one my_lm_task.py block"
    return blocks[0]


def test_the_language_model_task_of_the_docs_trains_its_adapters_on_a_local_checkpoint(tmp_path):
    (tmp_path / "my_lm_task.py").write_text(doc_task())
    torch.manual_seed(0)
    config = {"model_type": "gpt2", "vocab_size": 97, "n_positions": 64, "n_embd": 16, "n_layer": 1, "n_head": 2}
    build_base(config).save_pretrained(tmp_path / "ckpt")  # the "downloaded" checkpoint
    node = tmp_path / "node"
    node.mkdir()
    (node / "train.txt").write_text(TEXT)
    (node / "test.txt").write_text(TEXT[:700])
    task = load_task(f"{tmp_path / 'my_lm_task.py'}:task", {"base": str(tmp_path / "ckpt")})
    data = task.local_data(node)
    model = make_model(task, seed=1)
    spec = ParamSpec.of(model)
    assert all(".lora_" in e.name for e in spec.entries) and spec.numel == 8 * 16 + 48 * 8
    trainer = LocalTrainer(model, TrainConfig(epochs=3, batch_size=8, lr=0.01), task=task)
    start = trainer.flat.detach().clone()
    before = trainer.evaluate_data(start, data.test)
    after = trainer.evaluate_data(start + trainer.fit(start, data.train, seed=0).delta, data.test)
    assert after["perplexity"] < before["perplexity"]
