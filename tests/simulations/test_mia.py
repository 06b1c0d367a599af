"""The loss-threshold attack's metrics on scores whose answer is known."""

import numpy as np
import pytest

from shoal.simulations.mia import roc_auc, tpr_at_fpr


def test_auc_of_separable_identical_and_reversed_scores():
    a, b = np.arange(100.0, 200.0), np.arange(0.0, 100.0)
    assert roc_auc(a, b) == 1.0
    assert roc_auc(b, a) == 0.0
    assert roc_auc(a, a) == 0.5  # all ties count one half
    rng = np.random.default_rng(0)
    x, y = rng.normal(1.0, 1.0, 20_000), rng.normal(0.0, 1.0, 20_000)
    # two unit Gaussians one sigma apart: AUC = Phi(1 / sqrt(2)) = 0.7602
    assert roc_auc(x, y) == pytest.approx(0.7602, abs=0.01)


def test_tpr_at_fpr_keeps_false_positives_under_the_rate():
    non = np.arange(1000.0)  # non-member scores 0..999
    mem = np.array([995.5, 989.5, 500.0, 2000.0])
    # 1% of 1000 = 10 non-members may score above the threshold (990..999): threshold 989
    assert tpr_at_fpr(mem, non, 0.01) == 0.75
    assert tpr_at_fpr(mem, non, 0.0) == 0.25  # only the score above every non-member
    assert np.mean(non > np.sort(non)[::-1][10]) <= 0.01
