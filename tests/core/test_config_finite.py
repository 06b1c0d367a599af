"""No config value is NaN or Inf: a walk over every numeric field of every section (a NaN passes
every ``<`` and ``>`` range check, so each section's own checks alone would let it through)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from shoal.config import Config, config_from_dict
from shoal.config.sections import INFINITE_ALLOWED, check_finite
from shoal.errors import ConfigError


def _numeric_fields() -> list[tuple[str, str, bool]]:
    """(section, key, is_list) of every float-typed field (ints cannot hold NaN in TOML)."""
    out = []
    for sf in dataclasses.fields(Config):
        section = sf.default_factory()  # type: ignore[misc]
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            hint = hints[f.name]
            args = typing.get_args(hint)
            if hint is float or float in args:
                out.append((sf.name, f.name, False))
            elif typing.get_origin(hint) is list and args and args[0] is float:
                out.append((sf.name, f.name, True))
    return out


FIELDS = _numeric_fields()


def test_the_walk_finds_the_numbers():
    keys = {f"{s}.{k}" for s, k, _ in FIELDS}
    assert {"train.lr", "privacy.noise_multiplier", "secure_aggregation.clip", "server.deadline_s"} <= keys
    assert len(FIELDS) > 60


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_every_numeric_field_refuses_nan_and_inf(bad):
    """The walk Config.validate runs first, on each field of each section in turn."""
    for section, key, is_list in FIELDS:
        if bad == math.inf and f"{section}.{key}" in INFINITE_ALLOWED:
            continue
        value = [bad] if is_list else bad
        table = dataclasses.replace(getattr(Config(), section), **{key: value})
        with pytest.raises(ConfigError, match=rf"{section}\.{key}"):
            check_finite(table, section)


def test_a_config_with_nan_or_inf_is_refused_whole_and_a_full_batch_is_still_inf():
    with pytest.raises(ConfigError, match=r"task\.args\.scale = nan must be a finite number"):
        config_from_dict({"task": {"app": "m:t", "args": {"scale": math.nan}}}).validate()
    for key, bad in (("train.lr", math.nan), ("privacy.noise_multiplier", math.inf), ("server.deadline_s", -math.inf)):
        section, name = key.split(".")
        with pytest.raises(ConfigError, match=rf"{section}\.{name} = .* must be a finite number"):
            config_from_dict({section: {name: bad}}).validate()
    assert config_from_dict({"train": {"batch_size": math.inf}}).validate().train.batch_size == math.inf
