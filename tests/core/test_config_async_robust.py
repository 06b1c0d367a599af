"""Which robust rules an asynchronous run can use (FedBuff: all; FedAsync: the norm bound)."""

import pytest

from shoal.config import load_config
from shoal.errors import ConfigError


@pytest.mark.parametrize("mode", ['simulation.mode="async"', 'server.mode="async"'])
def test_fedasync_refuses_a_rule_over_one_update(mode):
    with pytest.raises(ConfigError, match=r"robust.rule = 'median' with asynchronous.algorithm = 'fedasync'"):
        load_config(None, [mode, 'asynchronous.algorithm="fedasync"', 'robust.rule="median"'])


def test_fedasync_takes_the_norm_bound_and_fedbuff_every_rule():
    load_config(None, ['simulation.mode="async"', 'asynchronous.algorithm="fedasync"', "robust.norm_bound=1.0"])
    for rule in ("median", "trimmed_mean", "krum", "multikrum"):
        load_config(None, ['simulation.mode="async"', f'robust.rule="{rule}"', "robust.krum_f=2"])
    # a sync run does not use [asynchronous]: its algorithm key does not matter
    load_config(None, ['asynchronous.algorithm="fedasync"', 'robust.rule="median"'])


def test_fedbuff_buffer_must_fit_the_rule():
    with pytest.raises(ConfigError, match="asynchronous.buffer_size = 10 exceeds robust.max_updates = 8"):
        load_config(None, ['simulation.mode="async"', 'robust.rule="median"', "robust.max_updates=8"])
    with pytest.raises(ConfigError, match=r"needs asynchronous.buffer_size > 2 krum_f \+ 2 = 10"):
        load_config(None, ['simulation.mode="async"', 'robust.rule="krum"', "robust.krum_f=4"])
