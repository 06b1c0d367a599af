import math

import pytest

from shoal.config import load_config
from shoal.errors import ConfigError


def test_defaults_are_the_builtin_demo():
    cfg = load_config()
    assert (cfg.data.dataset, cfg.model.name, cfg.simulation.num_clients) == ("synthetic", "logreg", 30)


def test_file_then_overrides(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text('[train]\nlr = 0.5\nbatch_size = inf\n[data]\ndataset = "mnist"\ndir = "/d"\n')
    cfg = load_config(p, ["train.lr=0.25", "data.dir=/other path", "train.epochs=3"])
    assert cfg.train.lr == 0.25 and cfg.train.epochs == 3
    assert cfg.data.dir == "/other path"
    assert cfg.train.batch_size == math.inf and cfg.train.batch(37) == 37


@pytest.mark.parametrize(
    "override,match",
    [
        ("train.lrr=0.1", r"unknown key 'train.lrr'"),
        ("nosuch.key=1", r"unknown section \[nosuch\]"),
        ("train.lr=fast", r"train.lr = 'fast' has the wrong type"),
        ("train.epochs=1.5", r"train.epochs = 1.5 has the wrong type"),
        ("train.epochs=0", r"train.epochs = 0 must be > 0"),
        ("model.name=resnet", r"model.name = 'resnet' is not one of"),
        ("data.dataset=mnist", r"data.dir is empty"),
        ("train.batch_size=2.5", r"train.batch_size"),
        ("trainlr", r"expected section.key=value"),
    ],
)
def test_bad_values_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    p = tmp_path / "bad.toml"
    p.write_text("[train\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    p.write_text("[train]\nnope = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'train.nope'"):
        load_config(p)


def test_set_one_task_argument_adds_to_the_files_args(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[task]\napp = "shoal.tasks:SyntheticPopulationTask"\n[task.args]\nalpha = 0.5\n')
    cfg = load_config(path, ["task.args.test_clients=20", "task.args.iid=true", "task.args.alpha=0.25"])
    assert cfg.task.args == {"alpha": 0.25, "test_clients": 20, "iid": True}
    for bad in ("model.name.x=1", "task.args.=3", "train.args.x=1"):
        with pytest.raises(ConfigError, match="section.key"):
            load_config(None, [bad])
