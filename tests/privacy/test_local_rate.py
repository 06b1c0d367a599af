"""Local DP-SGD's schedule. By default a round is a fixed number of steps at rate B / n_k, so the
step count (and a round's duration) does not tell n_k, and the node's ledger charges what the
trainer ran; with privacy.local_sampling_rate every client's DP-SGD runs the run's schedule, so
every client that took part the same number of times has the same epsilon, whatever its size."""

import pytest
import torch

from shoal.accounting import epsilon
from shoal.accounting_dpsgd import local_schedule
from shoal.client.dp_sgd import DpSgdTrainer
from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.models import build_model
from shoal.privacy_state import NodePrivacy
from shoal.simulations.inprocess import InProcessSimulation

LOCAL = ['privacy.mode="local"', "privacy.delta=1e-3", "train.batch_size=10", "train.epochs=1"]


def _steps_run(cfg, n: int) -> int:
    """The DP-SGD steps the trainer ran for a client of ``n`` examples (its own count)."""
    torch.manual_seed(0)
    trainer = DpSgdTrainer(build_model("logreg", (8,), 3), cfg.train, cfg.privacy)
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return int(trainer.train(trainer.flat.detach().clone(), x, y, seed=1).metrics["local_steps"])


def test_by_default_every_round_runs_the_same_steps_whatever_n_and_is_charged_for_them():
    cfg = load_config(None, LOCAL)
    for n in (40, 400):
        # an expected batch of B = 10 either way; the ledger charges the rate and steps the trainer ran
        assert local_schedule(n, cfg.train, cfg.privacy) == (10 / n, 10) == NodePrivacy(cfg, "a", n).schedule
        assert _steps_run(cfg, n) == 10
    steps = load_config(None, [*LOCAL, "privacy.local_steps=3"])
    assert _steps_run(steps, 400) == 3 and NodePrivacy(steps, "a", 400).schedule == (10 / 400, 3)
    # the opt-out: whole passes over the data, so the step count (and the round's time) tells n
    epochs = load_config(None, [*LOCAL, 'privacy.local_schedule="epochs"'])
    assert [_steps_run(epochs, n) for n in (40, 400)] == [4, 40]
    assert NodePrivacy(epochs, "a", 400).schedule == (10 / 400, 40)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (['privacy.local_schedule="epochs"', "privacy.local_sampling_rate=0.1"], "privacy.local_schedule"),
        (['privacy.local_schedule="epochs"', "privacy.local_steps=5"], "privacy.local_steps"),
        (["privacy.local_steps=-1"], "privacy.local_steps"),
        (["train.batch_size=inf"], "train.batch_size"),
        (['train.precision="bf16"'], "train.precision"),  # DP-SGD's steps run in float32, not ignored
        (['train.precision="tf32"'], "train.precision"),
    ],
)
def test_schedules_the_accounting_cannot_follow_are_refused(extra, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*LOCAL, *extra])


def test_clients_of_any_size_are_accounted_on_the_runs_schedule():
    cfg = load_config(
        None,
        [
            "simulation.rounds=1",
            "simulation.num_clients=6",
            "simulation.clients_per_round=6",
            'data.partition="dirichlet"',
            'privacy.mode="local"',
            "privacy.noise_multiplier=1.0",
            "privacy.delta=1e-4",
            "privacy.local_sampling_rate=0.05",
            "train.batch_size=10",
            "train.epochs=1",
            "privacy.reproducible=true",
        ],
    )
    sim = InProcessSimulation.from_config(cfg)
    sim.run_round()
    acc = sim.privacy.accountant
    assert len(set(acc.participations)) == 6 and set(acc.participations.values()) == {1}
    assert acc.state_dict()["schedules"] and {tuple(v) for v in acc.state_dict()["schedules"].values()} == {(0.05, 20)}
    assert sim.privacy.epsilon == pytest.approx(epsilon(0.05, 1.0, 20, 1e-4))
