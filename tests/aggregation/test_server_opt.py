"""Server optimizers against values computed by hand from Reddi et al. 2021, Algorithm 2
(and Hsu et al. 2019 for FedAvgM). Shared setup: lr = 0.5, beta1 = beta2 = 0.5,
tau = 0.1 (so v starts at tau**2 = 0.01), three coordinates."""

from math import sqrt

import pytest
import torch

from shoal.aggregation import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedAvgOpt,
    FedYogi,
    ServerOptimizer,
    make_server_optimizer,
)
from shoal.config import StrategyConfig

X0 = [1.0, -1.0, 0.5]
D1 = [2.0, -1.0, 0.0]
D2 = [1.0, 0.5, 0.2]


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _two_steps(opt: ServerOptimizer) -> tuple[torch.Tensor, torch.Tensor]:
    x1 = opt.step(_t(X0), _t(D1))
    x2 = opt.step(x1, _t(D2))
    return x1, x2


def _close(got: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_fedavg():
    x1, x2 = _two_steps(FedAvgOpt(1.0))
    _close(x1, [3.0, -2.0, 0.5])  # x0 + D1
    _close(x2, [4.0, -1.5, 0.7])  # x1 + D2
    _close(FedAvgOpt(0.5).step(_t(X0), _t(D1)), [2.0, -1.5, 0.5])  # x0 + 0.5*D1


def test_fedavgm():
    x1, x2 = _two_steps(FedAvgM(0.5, momentum=0.5))
    # v1 = D1 = [2, -1, 0];                 x1 = x0 + 0.5*v1 = [2, -1.5, 0.5]
    _close(x1, [2.0, -1.5, 0.5])
    # v2 = 0.5*v1 + D2 = [2, 0, 0.2];       x2 = x1 + 0.5*v2 = [3, -1.5, 0.6]
    _close(x2, [3.0, -1.5, 0.6])


def test_fedadam():
    x1, x2 = _two_steps(FedAdam(0.5, beta1=0.5, beta2=0.5, tau=0.1))
    # m1 = 0.5*D1 = [1, -0.5, 0]
    # v1 = 0.5*0.01 + 0.5*D1**2 = [2.005, 0.505, 0.005]
    e1 = [1.0 + 0.5 * 1.0 / (sqrt(2.005) + 0.1), -1.0 + 0.5 * -0.5 / (sqrt(0.505) + 0.1), 0.5]
    _close(x1, e1)
    # m2 = 0.5*m1 + 0.5*D2 = [1, 0, 0.1]
    # v2 = 0.5*v1 + 0.5*D2**2 = [1.5025, 0.3775, 0.0225]
    _close(x2, [e1[0] + 0.5 * 1.0 / (sqrt(1.5025) + 0.1), e1[1], 0.5 + 0.5 * 0.1 / (0.15 + 0.1)])


def test_fedyogi():
    x1, x2 = _two_steps(FedYogi(0.5, beta1=0.5, beta2=0.5, tau=0.1))
    # sign(v0 - D1**2) = sign([0.01-4, 0.01-1, 0.01-0]) = [-1, -1, +1]
    # v1 = v0 - 0.5*D1**2*sign = [0.01+2, 0.01+0.5, 0.01] = [2.01, 0.51, 0.01]
    e1 = [1.0 + 0.5 * 1.0 / (sqrt(2.01) + 0.1), -1.0 + 0.5 * -0.5 / (sqrt(0.51) + 0.1), 0.5]
    _close(x1, e1)
    # sign(v1 - D2**2) = sign([2.01-1, 0.51-0.25, 0.01-0.04]) = [+1, +1, -1]
    # v2 = [2.01-0.5*1, 0.51-0.5*0.25, 0.01+0.5*0.04] = [1.51, 0.385, 0.03]; m2 = [1, 0, 0.1]
    _close(x2, [e1[0] + 0.5 * 1.0 / (sqrt(1.51) + 0.1), e1[1], 0.5 + 0.5 * 0.1 / (sqrt(0.03) + 0.1)])


def test_fedadagrad():
    x1, x2 = _two_steps(FedAdagrad(0.5, beta1=0.5, tau=0.1))
    # m as FedAdam; v1 = 0.01 + D1**2 = [4.01, 1.01, 0.01]
    e1 = [1.0 + 0.5 * 1.0 / (sqrt(4.01) + 0.1), -1.0 + 0.5 * -0.5 / (sqrt(1.01) + 0.1), 0.5]
    _close(x1, e1)
    # v2 = v1 + D2**2 = [5.01, 1.26, 0.05]; m2 = [1, 0, 0.1]
    _close(x2, [e1[0] + 0.5 * 1.0 / (sqrt(5.01) + 0.1), e1[1], 0.5 + 0.5 * 0.1 / (sqrt(0.05) + 0.1)])


def test_fedadagrad_without_momentum_is_adagrad():
    x1 = FedAdagrad(0.5, beta1=0.0, tau=0.1).step(_t(X0), _t(D1))
    # m1 = D1; v1 = [4.01, 1.01, 0.01]
    _close(x1, [1.0 + 0.5 * 2.0 / (sqrt(4.01) + 0.1), -1.0 + 0.5 * -1.0 / (sqrt(1.01) + 0.1), 0.5])


ALL = {
    "fedavg": lambda: FedAvgOpt(0.7),
    "fedavgm": lambda: FedAvgM(0.5, 0.9),
    "fedadagrad": lambda: FedAdagrad(0.1, 0.9, 1e-3),
    "fedadam": lambda: FedAdam(0.1, 0.9, 0.99, 1e-3),
    "fedyogi": lambda: FedYogi(0.1, 0.9, 0.99, 1e-3),
}


@pytest.mark.parametrize("name", ALL)
def test_step_leaves_inputs_alone(name):
    x, d = _t(X0), _t(D1)
    new = ALL[name]().step(x, d)
    assert new is not x
    assert torch.equal(x, _t(X0)) and torch.equal(d, _t(D1))


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip_is_bit_exact(name):
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(64, generator=g) for _ in range(4)]
    a = ALL[name]()
    x = torch.randn(64, generator=g)
    for d in deltas[:2]:
        x = a.step(x, d)
    saved = a.state_dict()
    assert saved["steps"] == 2
    frozen = {k: v.clone() for k, v in saved.items() if isinstance(v, torch.Tensor)}
    b = ALL[name]()
    b.load_state_dict(saved)
    xa = xb = x
    for d in deltas[2:]:
        xa, xb = a.step(xa, d), b.step(xb, d)
        assert torch.equal(xa, xb)
    assert a.state_dict()["steps"] == b.state_dict()["steps"] == 4
    # neither a's nor b's later steps wrote into the saved snapshot
    assert all(torch.equal(saved[k], v) for k, v in frozen.items())


@pytest.mark.parametrize("name", ALL)
def test_state_is_allocated_lazily(name):
    opt = ALL[name]()
    assert opt.state_dict() == {"steps": 0}
    opt.load_state_dict({"steps": 0})  # a fresh optimizer's state loads too
    opt.step(_t(X0), _t(D1))
    for key, value in opt.state_dict().items():
        if key != "steps":
            assert value.shape == (3,) and value.dtype == torch.float32


def test_adaptive_state_starts_at_zero_and_tau_squared():
    opt = FedAdam(0.5, beta1=0.5, beta2=0.5, tau=0.1)
    opt.step(_t(X0), torch.zeros(3))
    state = opt.state_dict()
    # m0 = 0; v = 0.5*tau**2 + 0.5*0 = 0.005
    assert torch.equal(state["m"], torch.zeros(3))
    _close(state["v"], [0.005] * 3)


def test_load_state_dict_rejects_wrong_keys():
    with pytest.raises(ValueError, match="expected 'steps'"):
        FedAdam(0.1).load_state_dict({"steps": 1, "v": torch.ones(3)})
    with pytest.raises(ValueError, match="expected 'steps'"):
        FedAvgM(0.1).load_state_dict({"v": torch.ones(3)})


def test_state_of_another_size_is_refused_at_step():
    opt = FedAvgM(0.1)
    opt.load_state_dict({"steps": 1, "v": torch.ones(5)})
    with pytest.raises(ValueError, match="optimizer state 'v' has shape"):
        opt.step(_t(X0), _t(D1))


@pytest.mark.parametrize("name", ALL)
def test_shape_mismatch_raises(name):
    with pytest.raises(ValueError, match="equal-length vectors"):
        ALL[name]().step(_t(X0), torch.zeros(4))


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAvgOpt(0.0),
        lambda: FedAvgM(1.0, momentum=1.0),
        lambda: FedAdam(1.0, beta1=-0.1),
        lambda: FedYogi(1.0, beta2=1.0),
        lambda: FedAdagrad(1.0, tau=0.0),
    ],
)
def test_bad_hyperparameters_raise(make):
    with pytest.raises(ValueError, match="must be"):
        make()


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("fedavg", FedAvgOpt),
        ("fedavgm", FedAvgM),
        ("fedadagrad", FedAdagrad),
        ("fedadam", FedAdam),
        ("fedyogi", FedYogi),
    ],
)
def test_make_server_optimizer_reads_the_config(name, cls):
    cfg = StrategyConfig(name=name, server_lr=0.3, server_momentum=0.8, beta1=0.7, beta2=0.95, tau=0.01)
    opt = make_server_optimizer(cfg)
    assert type(opt) is cls and opt.lr == 0.3
    expected = {
        FedAvgOpt: {},
        FedAvgM: {"momentum": 0.8},
        FedAdagrad: {"beta1": 0.7, "tau": 0.01},
        FedAdam: {"beta1": 0.7, "beta2": 0.95, "tau": 0.01},
        FedYogi: {"beta1": 0.7, "beta2": 0.95, "tau": 0.01},
    }[cls]
    assert {k: getattr(opt, k) for k in expected} == expected


def test_make_server_optimizer_unknown_name():
    with pytest.raises(ValueError, match="no server optimizer"):
        make_server_optimizer(StrategyConfig(name="fedprox"))


def test_fedavg_step_into_writes_the_new_model_into_the_mean_and_equals_step():
    from shoal.aggregation.server_opt import FedAvgOpt

    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    for lr in (1.0, 0.5):
        opt, into = FedAvgOpt(lr), FedAvgOpt(lr)
        expected = opt.step(x, delta)
        mine = delta.clone()
        out = into.step_into(x, mine)
        assert out.data_ptr() == mine.data_ptr() and into.steps == 1
        if lr == 1.0:
            assert torch.equal(out, expected)
        else:
            torch.testing.assert_close(out, expected, rtol=2**-23, atol=0)
