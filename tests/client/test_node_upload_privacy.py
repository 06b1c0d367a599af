"""What a local-DP node's upload says beside its noisy update: nothing that tells neighbouring
datasets apart (issue 32's attack read train_loss, local_steps and num_examples there).

Two datasets that differ in one example are trained with the real DP-SGD trainer, protected
by NodePrivacy and encoded as the node encodes them; the attacker compares every header field
and finds them equal, so its best guess is a coin flip.

The node's privacy report (its epsilon) is a function of its schedule: with the default rate
B / n_k it would tell the two datasets apart, so under the default policy it is not sent at all
(the node enforces its budget itself); `privacy.release = "clear"` sends it anyway (the test
shows the leak); with ``privacy.local_sampling_rate`` the schedule is the config's, the whole
header, report included, is identical, and the server checks the report against the schedule
it computes itself."""

import pytest
import torch

from shoal.assembly import initial_model, make_trainer, task_from_config
from shoal.config import load_config
from shoal.privacy_state import NodePrivacy
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
    report = privacy.spend(1)  # as the node sends it: no field when there is no report
    body = encode_update(update, trainer.spec, {"round": 1, **({"privacy": report} if report is not None else {})})
    header, _ = read_header(body, 1 << 30)
    return header


@pytest.mark.slow
def test_local_dp_upload_headers_do_not_tell_neighbouring_datasets_apart():
    """The default config: the whole header, every field, is the same for n and n - 1."""
    for seed in range(2):
        d, d_minus_one = headers(41, seed), headers(40, seed)
        assert d == d_minus_one
        assert d["num_examples"] == 1 and d["metrics"] == {} and "privacy" not in d


def test_a_clear_release_sends_the_report_and_it_tells_the_sizes_apart():
    clear = 'privacy.release="clear"'
    d, d_minus_one = headers(41, 0, clear), headers(40, 0, clear)
    assert set(d["privacy"]) == {"epsilon", "epsilon_next", "delta", "rounds"}
    assert d["privacy"] != d_minus_one["privacy"]  # the leak the default closes
    assert {k: v for k, v in d.items() if k != "privacy"} == {k: v for k, v in d_minus_one.items() if k != "privacy"}


def test_a_server_that_withholds_reports_refuses_one_and_knows_no_epsilon():
    from shoal.errors import Malformed
    from shoal.server.privacy import ServerPrivacy

    server = ServerPrivacy(load_config(None, SETS), 10)
    assert server.reports_withheld and server.upload_report(None) is None
    with pytest.raises(Malformed, match="withholds the nodes' privacy reports"):
        server.upload_report(headers(41, 0, 'privacy.release="clear"')["privacy"])
    assert not server.reports and server.epsilon is None and server.next_epsilon is None
    assert server.allows_next_round()  # the nodes stop themselves
    record = server.record()
    assert record["epsilon"] is None and "nodes_reporting" not in record and "enforces" in record["accountant"]
    assert "node_epsilon" not in server.status()
    assert not any(line.startswith("shoal_privacy_epsilon ") for line in server.prometheus())


def test_with_the_runs_sampling_rate_the_report_is_identical_too_and_the_server_checks_it(tmp_path):
    from shoal.errors import Malformed
    from shoal.server.privacy import ServerPrivacy, parse_report

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
    with pytest.raises(Malformed, match="privacy.local_sampling_rate = 0.2 with 5 steps a round gives"):
        server.check_report(lying)
    server.take_report("n1", lying)  # where it can no longer be refused: the schedule's figures are shown
    assert server.reports["n1"]["epsilon"] == report["epsilon"]
