"""A node's evaluation log line shows the task's summarized figures (R², macro-F1), not the
raw per-example means the task derives them from (those still go to the server, which pools
every node's means and summarizes once)."""

from __future__ import annotations

from pathlib import Path

from shoal.client.node import figures_line
from shoal.task import Task, load_task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def test_a_regression_node_logs_r2_not_the_sums_it_comes_from():
    task = load_task(str(EXAMPLES / "regression_csv.py") + ":task")
    raw = {"loss": 0.25, "mse": 0.25, "target_mean": 1.0, "target_sq_mean": 2.25}  # Var(y) = 1.25
    line = figures_line(task, raw)
    assert line == "r2 0.8, loss 0.25"
    assert "target_mean" not in line and "target_sq_mean" not in line


class MacroF1(Task):
    """Per-class true positives, false positives and false negatives as means; F1 from them."""

    def summarize(self, means):
        f1 = []
        for c in (0, 1):
            tp, fp, fn = means[f"tp{c}"], means[f"fp{c}"], means[f"fn{c}"]
            f1.append(2 * tp / (2 * tp + fp + fn))
        return {"macro_f1": sum(f1) / 2, **means}


def test_a_classifier_node_logs_macro_f1_and_accuracy():
    raw = {"loss": 0.5, "accuracy": 0.75, "tp0": 0.4, "fp0": 0.1, "fn0": 0.15, "tp1": 0.35, "fp1": 0.15, "fn1": 0.1}
    assert figures_line(MacroF1(), raw) == "macro_f1 0.7494, loss 0.5, accuracy 0.75"


def test_a_task_that_derives_nothing_logs_its_means():
    assert figures_line(Task(), {"loss": 0.5, "accuracy": 0.9}) == "loss 0.5, accuracy 0.9"
