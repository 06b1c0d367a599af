"""Settings that are valid alone but cannot run together stop with one error naming them."""

import pytest

from shoal.config import load_config
from shoal.errors import ConfigError


@pytest.mark.parametrize(
    "sets, named",
    [
        (["secure_aggregation.enabled=true", 'robust.rule="median"'], "robust.rule"),
        (["secure_aggregation.enabled=true", 'compression.encoding="topk"'], "compression.encoding"),
        (["secure_aggregation.enabled=true", 'privacy.mode="central"'], "privacy.mode = 'distributed'"),
        (["secure_aggregation.enabled=true", 'simulation.mode="async"'], "simulation.mode"),
        (["secure_aggregation.enabled=true", "heterogeneity.enabled=true"], "heterogeneity.enabled"),
        (['privacy.mode="central"', "heterogeneity.enabled=true"], "heterogeneity.enabled"),
        (['privacy.mode="central"', 'robust.rule="krum"'], "robust.rule"),
        (['privacy.mode="central"', 'simulation.mode="gossip"'], "privacy.mode = 'local'"),
        (['privacy.mode="distributed"', 'simulation.mode="gossip"'], "privacy.mode = 'local'"),
        (['privacy.mode="local"', 'simulation.mode="async"'], "simulation.mode = 'sync' or 'gossip'"),
        (['privacy.mode="central"', 'simulation.mode="async"'], "simulation.mode = 'sync'"),
        (['privacy.mode="local"', "heterogeneity.enabled=true"], "heterogeneity.enabled"),
        (['simulation.engine="flower"', 'privacy.mode="central"'], "privacy.mode = 'central'"),
        (['simulation.engine="flower"', 'attack.kind="sign_flip"'], "attack.kind"),
        (['simulation.engine="flower"', 'simulation.mode="async"'], "simulation.mode"),
    ],
)
def test_combinations_that_cannot_run_are_refused(sets, named):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert named in str(e.value)


@pytest.mark.parametrize(
    "sets",
    [
        ["secure_aggregation.enabled=true", 'privacy.mode="distributed"'],
        ['simulation.engine="flower"', 'robust.rule="median"'],
        ['privacy.mode="local"', "simulation.batch_clients=8"],
        ['privacy.mode="local"', 'simulation.mode="gossip"'],
        ['privacy.mode="local"', 'simulation.mode="gossip"', 'gossip.algorithm="secure_groups"'],
        ['privacy.mode="local"', 'simulation.mode="gossip"', "privacy.target_epsilon=5"],
    ],
)
def test_combinations_that_run_are_accepted(sets):
    load_config(None, sets)
