"""shoal.hf: the base from a local config or checkpoint (never a download), PEFT adapters as the
only exchanged state, dict batches padded by the task, the loss read from the model's output,
per-token perplexity exact whatever the padding."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shoal.client.training import LocalTrainer  # noqa: E402 - after the skips
from shoal.config import TrainConfig  # noqa: E402
from shoal.hf import IGNORE_INDEX, HFTask, build_base, pad_collate  # noqa: E402
from shoal.params import ParamSpec  # noqa: E402
from shoal.task import DictDataset, TaskError, make_model  # noqa: E402

TINY = {
    "model_type": "gpt2",
    "vocab_size": 40,
    "n_positions": 16,
    "n_embd": 16,
    "n_layer": 2,
    "n_head": 2,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "lora_dropout": 0.0}


def examples(n: int = 24, seed: int = 0) -> DictDataset:
    """Sequences over a tiny alphabet with a learnable rule (each token = the previous + 1)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, 20, (n, 1), generator=g)
    ids = (start + torch.arange(12)) % 39 + 1
    return DictDataset(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())


def test_base_from_a_config_dict_a_config_file_or_a_checkpoint_folder(tmp_path):
    torch.manual_seed(0)
    a = build_base(TINY)
    torch.manual_seed(0)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(TINY))
    b = build_base(tmp_path / "cfg" / "config.json")
    c = build_base(tmp_path / "cfg")  # a folder with a config only: freshly initialised
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name  # same seed, same model
    assert type(a) is type(c)
    a.save_pretrained(tmp_path / "ckpt")
    loaded = build_base(tmp_path / "ckpt")
    for (name, p), q in zip(a.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name  # the checkpoint's weights, not a fresh init


def test_a_hub_name_is_refused_never_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskError, match="not a local file or folder; shoal never downloads"):
        build_base("gpt2")
    with pytest.raises(TaskError, match="no 'model_type'"):
        build_base({"n_embd": 8})
    with pytest.raises(TaskError, match="kind"):
        HFTask(TINY, kind="seq2seq")


def test_only_the_adapters_are_exchanged_and_trained():
    task = HFTask(TINY, peft=LORA)
    model = make_model(task, seed=1)
    spec = ParamSpec.of(model)
    assert spec.entries and all(".lora_A." in e.name or ".lora_B." in e.name for e in spec.entries)
    # 2 layers x (A: 4 x 16, B: 48 x 4)
    assert spec.numel == 2 * (4 * 16 + 48 * 4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = LocalTrainer(model, TrainConfig(epochs=3, batch_size=8, lr=0.05), task=task)
    start = trainer.flat.detach().clone()
    data = examples()
    before = trainer.evaluate_data(start, data)
    update = trainer.fit(start, data, seed=0)
    after = trainer.evaluate_data(start + update.delta, data)
    assert update.delta.numel() == spec.numel and update.delta.abs().max() > 0
    assert after["loss"] < before["loss"] and after["perplexity"] == pytest.approx(math.exp(after["loss"]))
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # the base did not move


def test_padding_counts_in_no_loss_and_perplexity_is_per_token():
    """Sequences of different lengths padded by the task's collate: the evaluation's loss is the
    mean over real next tokens, whatever the batches, equal to one direct computation."""
    task = HFTask(TINY, peft=LORA)
    task.collate_fn = pad_collate(0)
    model = make_model(task, seed=2)
    g = torch.Generator().manual_seed(5)
    items = []
    for length in (3, 12, 7, 9, 2, 12):
        ids = torch.randint(1, 40, (length,), generator=g)
        items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return len(items)

        def __getitem__(self, i):
            return items[i]

    batch = task.collate_fn(items[:2])
    assert batch["input_ids"].shape == (2, 12) and batch["attention_mask"][0].tolist() == [1] * 3 + [0] * 9
    assert (batch["labels"][0, 3:] == IGNORE_INDEX).all()
    trainer = LocalTrainer(model, TrainConfig(batch_size=4), task=task)
    params = trainer.flat.detach().clone()
    got = trainer.evaluate_data(params, Items(), batch_size=4)  # batches of 4 and 2, unequal token counts
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for it in items:
            logits = model(input_ids=it["input_ids"][None]).logits[0, :-1]
            nll += float(torch.nn.functional.cross_entropy(logits, it["labels"][1:], reduction="sum"))
            tokens += len(it["labels"]) - 1
    assert got["loss"] == pytest.approx(nll / tokens, rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    assert "nll_sum" not in got and 0 <= got["accuracy"] <= 1


def test_sequence_classification_exchanges_the_adapters_and_the_new_head():
    """PEFT keeps a trainable copy of the classifier head (modules_to_save): it travels too."""
    task = HFTask(TINY, kind="sequence-classification", peft=LORA, config_overrides={"num_labels": 3})
    model = make_model(task, seed=3)
    names = [e.name for e in ParamSpec.of(model).entries]
    assert any(".lora_A." in n for n in names) and any("score" in n for n in names), names
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (30, 8), generator=g)
    labels = ids[:, 0] % 3  # the class is told by the first token
    data = DictDataset(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    trainer = LocalTrainer(model, TrainConfig(epochs=5, batch_size=10, lr=0.05), task=task)
    start = trainer.flat.detach().clone()
    before = trainer.evaluate_data(start, data)
    after = trainer.evaluate_data(start + trainer.fit(start, data, seed=0).delta, data)
    assert after["loss"] < before["loss"]
    assert set(after) >= {"loss", "accuracy", "perplexity", "num_examples"} and after["num_examples"] == 30
