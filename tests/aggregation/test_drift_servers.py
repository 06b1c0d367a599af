"""The server halves of SCAFFOLD, FedNova and FedDyn against hand-computed one-round examples."""

from __future__ import annotations

import pytest
import torch

from shoal.aggregation.feddyn import FedDynStrategy
from shoal.aggregation.fednova import FedNovaStrategy
from shoal.aggregation.mean import WeightedMean
from shoal.aggregation.scaffold import ScaffoldControl
from shoal.aggregation.server_opt import FedAvgOpt
from shoal.update import Update


def up(v: float, n: int = 1, **metrics: float) -> Update:
    return Update(torch.tensor([v]), n, metrics=dict(metrics))


def test_scaffold_control_moves_by_the_sum_over_all_clients():
    control = ScaffoldControl(1, num_clients=4)
    control.add({"scaffold/dc": torch.tensor([1.0])})
    control.add({"scaffold/dc": torch.tensor([3.0])})
    control.step()  # c = 0 + (1 + 3) / 4
    assert control.broadcast()["scaffold/c"].item() == pytest.approx(1.0)
    control.step()  # a round with no accepted client leaves c
    assert control.c.item() == pytest.approx(1.0)


def test_fednova_normalises_unequal_local_steps():
    s = FedNovaStrategy(WeightedMean(1), FedAvgOpt(1.0), "examples")
    s.begin(torch.zeros(1))
    s.accumulate(up(2.0, fednova_a=2.0))
    s.accumulate(up(6.0, fednova_a=3.0))
    # mean of Delta/a = (1 + 2)/2 = 1.5, tau_eff = (2 + 3)/2 = 2.5: x = 3.75 (FedAvg: 4)
    assert s.finalize().item() == pytest.approx(3.75)
    s.begin(torch.zeros(1))
    with pytest.raises(ValueError, match="fednova_a"):
        s.accumulate(up(1.0))


def test_feddyn_server_state_and_step():
    s = FedDynStrategy(1, num_clients=4, alpha=0.5, device="cpu", weighting="uniform")
    s.begin(torch.zeros(1))
    s.accumulate(up(1.0))
    s.accumulate(up(3.0))
    # h = 0 - 0.5 * (2/4) * 2 = -0.5; theta = 0 + 2 - (-0.5)/0.5 = 3
    assert s.finalize().item() == pytest.approx(3.0)
    assert s.state_dict()["h"].item() == pytest.approx(-0.5)
    s.begin(torch.tensor([3.0]))
    s.accumulate(up(0.0))
    # h = -0.5 - 0.5 * (1/4) * 0 = -0.5; theta = 3 + 0 + 1 = 4
    assert s.finalize().item() == pytest.approx(4.0)
