import pytest

from shoal.config import load_config
from shoal.errors import ConfigError


def test_async_mode_and_sections_load():
    c = load_config(
        None,
        [
            'simulation.mode="async"',
            'asynchronous.algorithm="fedasync"',
            "heterogeneity.speed_sigma=1.5",
            "asynchronous.deadline_s=30",
        ],
    )
    assert c.simulation.mode == "async" and c.asynchronous.algorithm == "fedasync"
    assert c.heterogeneity.speed_sigma == 1.5 and c.asynchronous.deadline_s == 30.0


@pytest.mark.parametrize(
    "override, named",
    [
        ('simulation.mode="pipeline"', "simulation.mode"),
        ('asynchronous.algorithm="fedsgd"', "asynchronous.algorithm"),
        ("asynchronous.alpha=0", "asynchronous.alpha"),
        ('asynchronous.staleness_weight="exp"', "asynchronous.staleness_weight"),
        ('asynchronous.late="keep"', "asynchronous.late"),
        ("asynchronous.min_fraction=1.5", "asynchronous.min_fraction"),
        ("heterogeneity.mean_on_s=10", "heterogeneity.mean_off_s"),
        ("heterogeneity.step_time_s=0", "heterogeneity.step_time_s"),
    ],
)
def test_bad_values_name_their_key(override, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, [override])
