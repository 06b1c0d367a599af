"""The [privacy] config section: defaults, and errors that name the key."""

import pytest

from shoal.config import load_config
from shoal.errors import ConfigError


def test_defaults_are_off_and_valid():
    cfg = load_config(None)
    assert cfg.privacy.mode == "none" and cfg.privacy.accountant == "rdp"


@pytest.mark.parametrize(
    "override,match",
    [
        ("privacy.mode=cheap", "privacy.mode"),
        ("privacy.clip_norm=0", "privacy.clip_norm"),
        ("privacy.delta=1.5", "privacy.delta"),
        ("privacy.accountant=moments", "privacy.accountant"),
        ("privacy.sweep_modes=['none']", "privacy.sweep_modes"),
    ],
)
def test_bad_values_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_adaptive_clipping_needs_central_mode():
    with pytest.raises(ConfigError, match="adaptive_clipping"):
        load_config(None, ["privacy.mode=local", "privacy.adaptive_clipping=true"])
    assert load_config(None, ["privacy.mode=central", "privacy.adaptive_clipping=true"]).privacy.adaptive_clipping
