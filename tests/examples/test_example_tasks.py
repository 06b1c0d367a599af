"""The example tasks in examples/tasks/ as a user runs them: `shoal simulate --task FILE:task`
in a real subprocess, small settings, and each learns something measurable. Their
local_data(path) readers and file-writing helpers are exercised on files the helpers write."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig
from shoal.params import ParamSpec
from shoal.task import TaskError, load_task, make_model
from shoal.update import Update
from shoal.wire import encode_update
from tests.spawn import run_python

from ..conftest import REPO

TASKS = REPO / "examples" / "tasks"
ENV_1THREAD = {"OMP_NUM_THREADS": "1"}


def module(name: str):
    """An example task file as a module (for its helpers and constants)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", TASKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def simulate(tmp_path: Path, task: str, *sets: str) -> list[dict]:
    """`shoal simulate --task examples/tasks/TASK` with --set overrides; the metrics records."""
    import os

    args = ["simulate", "-q", "--task", f"examples/tasks/{task}", "--out", str(tmp_path)]
    for s in sets:
        args += ["--set", s]
    r = run_python(args, cwd=REPO, env={**os.environ, **ENV_1THREAD}, timeout=300)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def run_helper(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` from the repository root, forked warm as :func:`simulate`'s runs are."""
    r = run_python(list(args), module=None, script=REPO / script, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


# --- Shakespeare: character-level LSTM, one client per role ------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> Path:
    try:
        return module("shakespeare").find_corpus(None)
    except TaskError as e:
        pytest.skip(f"tinyshakespeare corpus absent (../shared/datasets/tinyshakespeare/input.txt): {e}")


@pytest.mark.slow
def test_shakespeare_learns_above_the_most_frequent_character(tmp_path, corpus):
    recs = simulate(
        tmp_path,
        "shakespeare.py:task",
        "task.args={max_roles = 4, hidden = 48, embed_dim = 16}",
        "simulation.rounds=4",
        "simulation.clients_per_round=0",
        "simulation.fraction=1.0",
        "train.batch_size=16",
        "train.lr=2.0",
    )
    assert [r["num_results"] for r in recs] == [4, 4, 4, 4]  # 4 roles, all train every round
    first, last = recs[0], recs[-1]
    assert last["test_loss"] < first["test_loss"] - 0.3
    for r in recs:  # perplexity is derived from the example-weighted mean loss
        assert r["test_perplexity"] == pytest.approx(math.exp(r["test_loss"]), rel=1e-9)
    # The most frequent character of the training text, as a predictor: the baseline to beat.
    sh = module("shakespeare")
    data = sh.Shakespeare(max_roles=4).simulation_data(4, 0)
    y_train = torch.cat([y for _, y in data.train]).flatten()
    top = int(torch.bincount(y_train).argmax())
    baseline = float((data.test[1] == top).float().mean())
    assert 0.1 < baseline < 0.25
    assert last["test_accuracy"] > baseline + 0.08, (last["test_accuracy"], baseline)
    # Clients' own test text (federated evaluation) covers the same speeches as the central test set.
    assert last["fed_num_examples"] == len(data.test[1])
    assert last["fed_accuracy"] == pytest.approx(last["test_accuracy"], abs=1e-6)


def test_shakespeare_roles_split_and_local_data_match_the_simulation(tmp_path, corpus):
    sh = module("shakespeare")
    task = load_task(str(TASKS / "shakespeare.py") + ":task", {"max_roles": 3})
    data = task.simulation_data(30, 0)  # max_roles caps the clients
    assert list(data.client_ids) == ["gloucester", "duke_vincentio", "king_richard_ii"]
    for (x, y), (_tx, ty) in zip(data.train, data.client_test):
        assert x.dtype == torch.int64 and x.shape[1] == 80 and y.shape == x.shape
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one character
        assert len(ty) > 0 and len(ty) < len(y) / 5  # every 10th speech is held out
    # The helper writes each role's train/test text; local_data reads exactly the simulation's tensors.
    out = run_helper("examples/tasks/shakespeare.py", "write-roles", str(tmp_path), "--roles", "3")
    folders = [Path(p) for p in out.stdout.split()]
    assert [f.name for f in folders] == list(data.client_ids)
    for folder, train, test in zip(folders, data.train, data.client_test):
        local = task.local_data(folder)
        assert torch.equal(local.train[0], train[0]) and torch.equal(local.train[1], train[1])
        assert torch.equal(local.test[0], test[0]) and torch.equal(local.test[1], test[1])
    single = task.local_data(folders[0] / "train.txt")  # one file: training text, no test
    assert single.test is None and len(single.train[1]) == len(data.train[0][1])
    assert sh.decode(single.train[0][0][:20]) == (folders[0] / "train.txt").read_text()[:20]


@pytest.mark.slow
def test_shakespeare_central_baseline_script(tmp_path, corpus):
    """The docs' baseline script: same model and trainer on the pooled text, a table beside a federated run."""
    sets = ["task.args={max_roles = 2, hidden = 16, embed_dim = 8}", "simulation.rounds=2", "train.batch_size=16"]
    fed = simulate(
        tmp_path / "fed",
        "shakespeare.py:task",
        *sets,
        "simulation.clients_per_round=0",
        "simulation.fraction=1.0",
        "train.lr=2.0",
    )
    args = [
        "examples/tasks/shakespeare_central.py",
        "-c",
        "examples/tasks/shakespeare.toml",
        "--out",
        str(tmp_path / "central"),
        "--federated",
        str(tmp_path / "fed"),
    ]
    for s in sets:
        args += ["--set", s]
    out = run_helper(*args).stdout
    central = [json.loads(line) for line in (tmp_path / "central" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in central] == [1, 2]
    # Each round-equivalent processes what a federated round with every client does.
    assert central[0]["examples"] == fed[0]["num_examples"]
    assert "most-frequent-character baseline" in out
    assert f"| 2 | {fed[1]['test_accuracy']:.4f} | {central[1]['test_accuracy']:.4f} |" in out


@pytest.mark.slow
def test_shakespeare_bad_paths_give_one_clear_line(tmp_path):
    task = load_task(str(TASKS / "shakespeare.py") + ":task")
    with pytest.raises(TaskError, match="does not exist"):
        task.local_data(tmp_path / "nowhere")
    with pytest.raises(TaskError, match="has no train.txt"):
        task.local_data(tmp_path)
    (tmp_path / "train.txt").write_text("too short")
    with pytest.raises(TaskError, match="fewer than 81 characters"):
        task.local_data(tmp_path)
    r = run_python(
        [
            "simulate",
            "-q",
            "--task",
            "examples/tasks/shakespeare.py:task",
            "--out",
            str(tmp_path / "o"),
            "--set",
            'task.args={path = "/nonexistent/input.txt"}',
        ],
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/nonexistent/input.txt" in lines[0], r.stderr


# --- regression on CSV files ------------------------------------------------------------------------


@pytest.mark.slow
def test_regression_learns_and_r2_is_exact_from_the_means(tmp_path):
    recs = simulate(
        tmp_path,
        "regression_csv.py:task",
        "simulation.rounds=12",
        "simulation.num_clients=8",
        "simulation.clients_per_round=4",
        "train.lr=0.05",
        "train.batch_size=16",
    )
    first, last = recs[0], recs[-1]
    assert last["test_mse"] < 0.5 * first["test_mse"]
    assert last["test_r2"] > 0.8
    for r in recs:  # R² of the pooled test set, from the example-weighted moments
        var = r["test_target_sq_mean"] - r["test_target_mean"] ** 2
        assert r["test_r2"] == pytest.approx(1 - r["test_mse"] / var, rel=1e-9)
    # Checked against a direct computation on the same central test set, with the initial model.
    task = load_task(str(TASKS / "regression_csv.py") + ":task")
    data = task.simulation_data(8, 0)
    model = make_model(task, 0)
    trainer = LocalTrainer(model, TrainConfig(), task=task)
    ev = trainer.evaluate_data(trainer.flat.detach().clone(), data.test, batch_size=7)  # uneven batches
    x, y = data.test
    with torch.no_grad():
        direct = 1 - float(((model(x) - y) ** 2).mean() / y.var(unbiased=False))
    assert ev["r2"] == pytest.approx(direct, rel=1e-5)


def test_regression_csv_files_round_trip(tmp_path):
    out = run_helper("examples/tasks/regression_csv.py", "write-csvs", str(tmp_path), "--nodes", "3")
    folders = [Path(p) for p in out.stdout.split()]
    assert [f.name for f in folders] == ["node-0", "node-1", "node-2"]
    task = load_task(str(TASKS / "regression_csv.py") + ":task")
    sim = task.simulation_data(3, 0)
    for folder, (x, y), (_tx, ty) in zip(folders, sim.train, sim.client_test):
        assert (folder / "train.csv").read_text().splitlines()[0] == "x0,x1,x2,x3,x4,x5,x6,x7,y"
        local = task.local_data(folder)
        assert torch.allclose(local.train[0], x, rtol=1e-5, atol=1e-5)  # written with 6 significant digits
        assert torch.allclose(local.train[1], y, rtol=1e-5, atol=1e-5)
        assert torch.allclose(local.test[1], ty, rtol=1e-5, atol=1e-5)
    # A .csv file with test.csv beside it, and one without: then a fixed 20% split.
    assert len(task.local_data(folders[0] / "train.csv").test[1]) == len(sim.client_test[0][1])
    (tmp_path / "solo").mkdir()
    (tmp_path / "solo" / "mine.csv").write_text((folders[0] / "train.csv").read_text())
    solo = task.local_data(tmp_path / "solo" / "mine.csv")
    n = len(sim.train[0][1])
    assert len(solo.test[1]) == int(n * 0.2) and len(solo.train[1]) + len(solo.test[1]) == n
    # The node's data trains: one local fit from the initial model.
    trainer = LocalTrainer(make_model(task, 0), TrainConfig(lr=0.05, batch_size=16), task=task)
    update = trainer.fit(trainer.flat.detach().clone(), solo.train, seed=1)
    assert update.num_examples == len(solo.train[1]) and torch.isfinite(update.delta).all()


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "needs a header row and at least one data row"),
        ("x0,x1,x2,x3,x4,x5,x6,x7,y\n", "needs a header row and at least one data row"),
        ("x0,x1,x2,x3,x4,x5,x6,x7,target\n1,2,3,4,5,6,7,8,9\n", "no target column 'y'"),
        ("x0,x1,x2,y\n1,2,3,4\n", "has 3 feature columns"),
        ("x0,x1,x2,x3,x4,x5,x6,x7,y\n1,2,3,4,5,6,7,8,9\n1,2,3\n", "line 3 has 3 fields, the header has 9"),
        ("x0,x1,x2,x3,x4,x5,x6,x7,y\n1,2,3,4,abc,6,7,8,9\n", "line 2, column 'x4': 'abc' is not a number"),
        ("x0,x1,x2,x3,x4,x5,x6,x7,y\n1,2,3,4,5,6,7,8,nan\n", "inf or nan"),
    ],
    ids=["empty", "header-only", "no-target", "feature-count", "ragged", "not-a-number", "nan"],
)
def test_regression_malformed_csv_is_one_clear_error(tmp_path, text, needle):
    (tmp_path / "train.csv").write_text(text)
    task = load_task(str(TASKS / "regression_csv.py") + ":task")
    with pytest.raises(TaskError, match="regression: .*" + needle.replace("(", r"\(")) as e:
        task.local_data(tmp_path)
    assert "\n" not in str(e.value)


def test_regression_missing_csv_is_one_clear_error(tmp_path):
    task = load_task(str(TASKS / "regression_csv.py") + ":task")
    with pytest.raises(TaskError, match="train.csv' not found"):
        task.local_data(tmp_path)


# --- images with BatchNorm, read from PNG folders through a DataLoader --------------------------------


def bn_buffer_numel(task) -> int:
    model = task.model()
    return sum(b.numel() for n, b in model.named_buffers() if b.is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [True, False], ids=["fedavg-bn-stats", "fedbn"])
def test_image_task_learns_with_and_without_exchanging_bn_stats(tmp_path, exchange):
    recs = simulate(
        tmp_path,
        "image_folder_bn.py:task",
        f"task.args={{exchange_buffers = {str(exchange).lower()}}}",
        "simulation.rounds=8",
        "simulation.num_clients=6",
        "simulation.clients_per_round=6",
        "train.lr=0.05",
        "train.batch_size=16",
        "train.epochs=2",
    )
    last = recs[-1]
    assert last["fed_accuracy"] > 0.5  # 4 classes: chance is 0.25
    assert last["fed_loss"] < recs[0]["fed_loss"]
    # Central test set only where one set of BN statistics serves every client's pictures.
    assert ("test_accuracy" in last) == exchange
    task = load_task(str(TASKS / "image_folder_bn.py") + ":task", {"exchange_buffers": exchange})
    model = make_model(task, 0)
    spec = ParamSpec.of(model, exchange_buffers=exchange)
    trainable = sum(p.numel() for p in model.parameters())
    assert spec.numel == trainable + (bn_buffer_numel(task) if exchange else 0)
    per_result = last["bytes_up"] / last["num_results"]
    assert 4 * spec.numel < per_result < 4 * spec.numel + 1024


def test_image_simulation_trains_through_the_dataloader_path():
    from shoal.config import load_config
    from shoal.simulations.inprocess import InProcessSimulation

    cfg = load_config(
        None, [f'task.app="{TASKS / "image_folder_bn.py"}:task"', "simulation.num_clients=3", "simulation.rounds=1"]
    )
    sim = InProcessSimulation.from_config(cfg)
    assert not sim.shards.in_memory and sim.batched is None  # Datasets, not tensors: the DataLoader path
    sim.run_round()
    assert 0 <= sim.evaluate()["test_accuracy"] <= 1


def test_image_png_folders_round_trip(tmp_path):
    out = run_helper("examples/tasks/image_folder_bn.py", "write-pngs", str(tmp_path), "--nodes", "2", "--images", "12")
    folders = [Path(p) for p in out.stdout.split()]
    task = load_task(str(TASKS / "image_folder_bn.py") + ":task", {"images": 12})
    sim = task.simulation_data(2, 0)
    for folder, train, _test in zip(folders, sim.train, sim.client_test):
        local = task.local_data(folder)
        assert len(local.train) == 12 and len(local.test) == 3
        # PNG is lossless: every picture read back equals the generated one, under the same transform.
        got = sorted((int(y), x.flatten().tolist()) for x, y in (local.train[i] for i in range(len(local.train))))
        want = sorted((int(y), x.flatten().tolist()) for x, y in (train[i] for i in range(len(train))))
        assert got == want
        x0, y0 = local.train[0]
        assert x0.shape == (3, 16, 16) and x0.dtype == torch.float32 and isinstance(y0, int)
    # The class subfolders alone (no train/ level) are training data.
    only = task.local_data(folders[0] / "train")
    assert len(only.train) == 12 and only.test is None
    # The folder trains through a DataLoader.
    trainer = LocalTrainer(make_model(task, 0), TrainConfig(lr=0.05, batch_size=4), task=task)
    update = trainer.fit(trainer.flat.detach().clone(), only.train, seed=3)
    assert update.num_examples == 12 and update.metrics["local_steps"] == 3 and torch.isfinite(update.delta).all()
    ev = trainer.evaluate_data(trainer.flat.detach().clone(), task.local_data(folders[0]).test)
    assert ev["num_examples"] == 3


def test_image_bad_folders_give_clear_errors(tmp_path):
    with pytest.raises(TaskError, match="exchange_buffers = 'false' must be true or false"):
        load_task(str(TASKS / "image_folder_bn.py") + ":task", {"exchange_buffers": "false"})
    task = load_task(str(TASKS / "image_folder_bn.py") + ":task")
    with pytest.raises(TaskError, match="is not a folder"):
        task.local_data(tmp_path / "nowhere")
    with pytest.raises(TaskError, match="no .png file"):
        task.local_data(tmp_path)
    (tmp_path / "dog").mkdir()
    with pytest.raises(TaskError, match="dog is not a class of this task; class folders are circle, square"):
        task.local_data(tmp_path)
    (tmp_path / "dog").rmdir()
    (tmp_path / "circle").mkdir()
    (tmp_path / "circle" / "broken.png").write_bytes(b"not a png")
    data = task.local_data(tmp_path).train
    with pytest.raises(TaskError, match="cannot read image .*broken.png"):
        data[0]


# --- a frozen pretrained-style base with LoRA adapters: only the adapters travel ----------------------


@pytest.mark.slow
def test_adapter_sends_only_the_adapter_and_learns(tmp_path):
    recs = simulate(
        tmp_path,
        "adapter.py:task",
        "simulation.rounds=8",
        "simulation.num_clients=10",
        "simulation.clients_per_round=5",
        "train.lr=0.05",
        "train.batch_size=32",
        "train.epochs=2",
    )
    task = load_task(str(TASKS / "adapter.py") + ":task")
    model = make_model(task, 0)
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert adapter == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert frozen > 10 * adapter
    spec = ParamSpec.of(model)
    assert spec.numel == adapter and all("lora_" in e.name for e in spec.entries)
    # The wire overhead, measured: the same update message with a zero delta (header + safetensors framing).
    body = encode_update(
        Update(
            delta=torch.zeros(spec.numel),
            num_examples=200,
            base_version=7,
            sender="client-00003",
            metrics={"train_loss": 1.2345678901234567, "local_steps": 14.0},
        ),
        spec,
    )
    overhead = len(body) - 4 * adapter
    assert 0 < overhead < 1024
    for r in recs:
        per_result = r["bytes_up"] / r["num_results"]
        assert abs(per_result - (4 * adapter + overhead)) <= 16, (per_result, adapter, overhead)
    # It learns: the fine-tuned global model beats the frozen base on the downstream test set.
    data = task.simulation_data(10, 0)
    with torch.no_grad():
        base_acc = float((model(data.test[0]).argmax(-1) == data.test[1]).float().mean())
    assert recs[-1]["test_accuracy"] > base_acc + 0.1, (recs[-1]["test_accuracy"], base_acc)
