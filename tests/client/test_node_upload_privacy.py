"""What a local-DP node's upload says beside its noisy update: nothing that tells neighbouring
datasets apart (issue 32's attack read train_loss, local_steps and num_examples there).

Two datasets that differ in one example are trained with the real DP-SGD trainer, protected
by NodePrivacy and encoded as the node encodes them; the attacker compares every header field
but the node's privacy report (its epsilon, a function of the schedule that DP-SGD's analysis
takes as public: docs/privacy.md) and finds them equal, so its best guess is a coin flip.

The report itself is a function of the schedule: with the default rate B / n_k it tells the two
datasets apart (the test shows it); with ``privacy.local_sampling_rate`` the schedule is the
config's and the whole header, report included, is identical, and the server checks the report
against the schedule it computes itself."""

import pytest
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


def headers(n: int, seed: int, *extra: str) -> dict:
    cfg = load_config(None, [*SETS, *extra])
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


def test_with_the_runs_sampling_rate_the_report_is_identical_too_and_the_server_checks_it(tmp_path):
    from shoal.errors import Malformed
    from shoal.server.privacy import ServerPrivacy, parse_report

    # the default rate B / n_k: the report alone tells n = 41 from n = 40 (the leak the rate closes)
    assert headers(41, 0)["privacy"] != headers(40, 0)["privacy"]
    fixed = "privacy.local_sampling_rate=0.2"
    for seed in range(2):
        d, d_minus_one = headers(41, seed, fixed), headers(40, seed, fixed)
        assert d == d_minus_one and d["num_examples"] == 1 and d["metrics"] == {}
    cfg = load_config(None, [*SETS, fixed])
    server = ServerPrivacy(cfg, 10)
    report = parse_report(headers(23, 0, fixed)["privacy"], 1e-3)  # any size: the same report
    assert server.check_report(report) == server.public_report(1) == report
    server.take_report("n0", report)
    assert server.status()["node_epsilon"]["n0"]["epsilon"] == report["epsilon"]
    assert "sampling rate q = 0.2" in server.describe()
    lying = {**report, "epsilon": report["epsilon"] / 2}
    with pytest.raises(Malformed, match="privacy.local_sampling_rate = 0.2 with 1 epochs gives"):
        server.check_report(lying)
    server.take_report("n1", lying)  # where it can no longer be refused: the schedule's figures are shown
    assert server.reports["n1"]["epsilon"] == report["epsilon"]
