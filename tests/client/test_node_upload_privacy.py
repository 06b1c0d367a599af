"""What a local-DP node's upload says beside its noisy update: nothing that tells neighbouring
datasets apart (issue 32's attack read train_loss, local_steps and num_examples there).

Two datasets that differ in one example are trained with the real DP-SGD trainer, protected
by NodePrivacy and encoded as the node encodes them; the attacker compares every header field
but the node's privacy report (its epsilon, a function of the schedule that DP-SGD's analysis
takes as public: docs/privacy.md) and finds them equal, so its best guess is a coin flip."""

import torch

from shoal.assembly import initial_model, make_trainer, task_from_config
from shoal.client.node import NodePrivacy
from shoal.config import load_config
from shoal.wire import encode_update, read_header

SETS = [
    'privacy.mode="local"',
    "privacy.noise_multiplier=1.0",
    "privacy.delta=1e-3",
    'model.name="logreg"',
    "train.batch_size=8",
    "train.epochs=1",
]


def headers(n: int, seed: int) -> dict:
    cfg = load_config(None, SETS)
    task = task_from_config(cfg)
    task.input_shape, task.num_classes = (60,), 10
    trainer = make_trainer(cfg, task, initial_model(cfg, task), torch.device("cpu"))
    g = torch.Generator().manual_seed(100)
    x, y = torch.randn(41, 60, generator=g), torch.randint(0, 10, (41,), generator=g)
    privacy = NodePrivacy(cfg, "n0", n, None)
    update = trainer.fit(trainer.flat.detach().clone(), (x[:n], y[:n]), seed, 0, "n0")
    assert "train_loss" in update.metrics  # the trainer knows it; the upload must not carry it
    update = privacy.protect(update, {"round": 1})
    body = encode_update(update, trainer.spec, {"round": 1, "privacy": privacy.spend(1)})
    header, _ = read_header(body, 1 << 30)
    return header


def test_local_dp_upload_headers_do_not_tell_neighbouring_datasets_apart():
    for seed in range(2):
        d, d_minus_one = headers(41, seed), headers(40, seed)
        assert d["num_examples"] == d_minus_one["num_examples"] == 1 and d["metrics"] == d_minus_one["metrics"] == {}
        same = {k: v for k, v in d.items() if k != "privacy"}
        assert same == {k: v for k, v in d_minus_one.items() if k != "privacy"}
        assert set(d["privacy"]) == {"epsilon", "epsilon_next", "delta", "rounds"}
