import pytest

from shoal.errors import ConfigError
from shoal.models import build_model, count_parameters


@pytest.mark.parametrize(
    "name,shape,classes,count",
    [
        ("logreg", (1, 28, 28), 10, 7_850),
        ("logreg", (60,), 10, 610),
        ("2nn", (1, 28, 28), 10, 199_210),  # McMahan et al. 2017
        ("cnn", (1, 28, 28), 10, 1_663_370),  # McMahan et al. 2017, same padding
        ("femnist_cnn", (1, 28, 28), 62, 6_603_710),  # LEAF's CNN (FC 2048)
    ],
)
def test_parameter_counts(name, shape, classes, count):
    assert count_parameters(build_model(name, shape, classes)) == count


def test_cnn_on_vector_data_is_a_clear_error():
    with pytest.raises(ConfigError, match="needs 28x28 images"):
        build_model("cnn", (60,), 10)
