"""Each algorithm's client step against a hand-computed one-step example.

The model is one weight w (or a body b and a head h, f(x) = h b x), one example x = 1, y = 0,
loss (f(x) - y)^2, so dL/dw = 2w and one SGD step with lr 0.1 is easy to follow by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.client.algorithms import fednova_norm, make_program, personal_mask
from shoal.client.training import LocalTrainer
from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.rounds import Assignment
from shoal.task import Task

DATA = (torch.ones(1, 1), torch.zeros(1))


class Square(Task):
    """f(x) = w x, loss (f(x) - y)^2."""

    def model(self):
        m = nn.Linear(1, 1, bias=False)
        nn.init.ones_(m.weight)
        return m

    def loss(self, model, x, y):
        return F.mse_loss(model(x).squeeze(-1), y)


class BodyHead(Square):
    """f(x) = h b x with a body b and a personal head h, both 1 at start."""

    personal = ("head",)

    def model(self):
        m = nn.Sequential()
        m.add_module("body", nn.Linear(1, 1, bias=False))
        m.add_module("head", nn.Linear(1, 1, bias=False))
        for p in m.parameters():
            nn.init.ones_(p)
        return m


def program(name: str, task: Task, *extra: str):
    cfg = load_config(None, [f"algorithm.name='{name}'", "train.lr=0.1", "train.batch_size=1", *extra])
    trainer = LocalTrainer(task.model(), cfg.train, "cpu", task=task)
    return make_program(cfg, task, trainer), trainer


def assignment() -> Assignment:
    return Assignment(client_id="c", round=1, version=0, seed=7)


def t(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def test_scaffold_step_and_option_ii_control_variate():
    prog, _ = program("scaffold", Square())
    out = prog.fit(DATA, assignment(), t(1.0), {"scaffold/c": t(0.2)}, {"scaffold/c": t(0.5)})
    # y = 1 - 0.1 (2 - 0.2 + 0.5) = 0.77; c_i+ = 0.2 - 0.5 + (1 - 0.77) / (1 * 0.1) = 2.0
    assert out.update.delta.item() == pytest.approx(-0.23, abs=1e-6)
    assert out.state["scaffold/c"].item() == pytest.approx(2.0, abs=1e-5)
    assert out.to_server["scaffold/dc"].item() == pytest.approx(1.8, abs=1e-5)


def test_feddyn_step_and_gradient_memory():
    prog, _ = program("feddyn", Square(), "algorithm.feddyn_alpha=0.5")
    out = prog.fit(DATA, assignment(), t(1.0), {"feddyn/grad": t(0.4)}, {})
    # grad = 2 - 0.4 + 0.5 (1 - 1) = 1.6, w = 0.84; grad_k = 0.4 - 0.5 (0.84 - 1) = 0.48
    assert out.update.delta.item() == pytest.approx(-0.16, abs=1e-6)
    assert out.state["feddyn/grad"].item() == pytest.approx(0.48, abs=1e-6)


def test_fednova_reports_the_momentum_step_weight():
    # ||a||_1 for tau = 3, rho = 0.5: (1 - .125)/.5 + (1 - .25)/.5 + (1 - .5)/.5 = 4.25
    assert fednova_norm(3, 0.5) == pytest.approx(4.25)
    assert fednova_norm(5, 0.0) == 5
    prog, _ = program("fednova", Square(), "train.epochs=3", "train.momentum=0.5")
    out = prog.fit(DATA, assignment(), t(1.0), {}, {})
    assert out.update.metrics["fednova_a"] == pytest.approx(4.25)


def test_ditto_sends_the_fedavg_update_and_keeps_a_personal_model():
    prog, _ = program("ditto", Square(), "algorithm.ditto_lambda=0.5")
    out = prog.fit(DATA, assignment(), t(1.0), {"ditto/v": t(2.0)}, {})
    # global: 1 - 0.1 * 2 = 0.8; personal: v = 2 - 0.1 (2 * 2 + 0.5 (2 - 1)) = 1.55
    assert out.update.delta.item() == pytest.approx(-0.2, abs=1e-6)
    assert out.state["ditto/v"].item() == pytest.approx(1.55, abs=1e-6)
    assert prog.personal_model(t(1.0), out.state).item() == pytest.approx(1.55, abs=1e-6)


def test_fedper_trains_both_parts_and_keeps_the_head():
    prog, trainer = program("fedper", BodyHead())
    assert personal_mask(trainer.spec, ("head",)).tolist() == [False, True]
    out = prog.fit(DATA, assignment(), t(1.0, 1.0), {}, {})
    # dL/db = 2 h^2 b = 2, dL/dh = 2 h b^2 = 2: both become 0.8; the head's change stays here
    assert out.update.delta.tolist() == pytest.approx([-0.2, 0.0], abs=1e-6)
    assert out.state["personal"].tolist() == pytest.approx([0.8], abs=1e-6)
    # next round starts from the global body and the client's own head
    assert prog.personal_model(t(0.5, 1.0), out.state).tolist() == pytest.approx([0.5, 0.8], abs=1e-6)


def test_fedrep_trains_the_head_first_then_the_body():
    prog, _ = program("fedrep", BodyHead())
    out = prog.fit(DATA, assignment(), t(1.0, 1.0), {}, {})
    # head: h = 1 - 0.1 * 2 = 0.8 (body fixed); body: dL/db = 2 * 0.8^2 * 1 = 1.28, b = 0.872
    assert out.update.delta.tolist() == pytest.approx([-0.128, 0.0], abs=1e-6)
    assert out.state["personal"].tolist() == pytest.approx([0.8], abs=1e-6)
    assert out.update.metrics["local_steps"] == 2


def test_personal_parts_the_task_does_not_name_are_a_config_error():
    with pytest.raises(ConfigError, match="personal"):
        program("fedper", Square())


def test_fine_tuning_for_personalised_evaluation_starts_from_the_personal_model():
    prog, _ = program("ditto", Square())
    tuned = prog.fine_tuned(DATA, t(1.0), {"ditto/v": t(2.0)}, steps=1, seed=0)
    assert tuned.item() == pytest.approx(2.0 - 0.1 * 4.0, abs=1e-6)
    assert prog.fine_tuned(DATA, t(1.0), {}, steps=0, seed=0).item() == 1.0


def test_fedrep_fine_tunes_the_head_alone():
    prog, _ = program("fedrep", BodyHead())
    tuned = prog.fine_tuned(DATA, t(1.0, 1.0), {"personal": t(1.0)}, steps=1, seed=0)
    assert tuned.tolist() == pytest.approx([1.0, 0.8], abs=1e-6)  # dL/dh = 2: the head moves, the body stays


def test_kept_optimizer_state_starts_the_next_round_from_the_last_momentum():
    prog, _ = program("fedavg", Square(), "train.momentum=0.5", "algorithm.keep_optimizer_state=true")
    first = prog.fit(DATA, assignment(), t(1.0), {}, {})
    # m = 2 (grad at w = 1), w = 0.8; saved m = 2
    assert first.state["optimizer/momentum"].item() == pytest.approx(2.0)
    second = prog.fit(DATA, assignment(), t(1.0), first.state, {})
    # m = 0.5 * 2 + 2 = 3, w = 1 - 0.3 = 0.7 (from zero momentum it would be 0.8 again)
    assert second.update.delta.item() == pytest.approx(-0.3, abs=1e-6)
    assert prog.fit(DATA, assignment(), t(1.0), {}, {}).update.delta.item() == pytest.approx(-0.2, abs=1e-6)


def test_kept_optimizer_state_is_refused_where_it_has_no_meaning():
    with pytest.raises(ConfigError, match="no optimizer state"):
        load_config(None, ["algorithm.keep_optimizer_state=true"])
    with pytest.raises(ConfigError, match="two local trainings"):
        load_config(None, ["algorithm.keep_optimizer_state=true", "train.momentum=0.9", "algorithm.name='ditto'"])
