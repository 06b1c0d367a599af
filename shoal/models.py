"""The models of the FedAvg / FedProx / LEAF papers, by name.

| name        | paper                              | parameters (MNIST, 10 classes) |
|-------------|------------------------------------|--------------------------------|
| logreg      | multinomial logistic regression    | 7,850 (784 inputs)             |
| 2nn         | McMahan et al. 2017, "2NN"         | 199,210                        |
| cnn         | McMahan et al. 2017, "CNN"         | 1,663,370 (same padding)       |
| femnist_cnn | LEAF (Caldas et al. 2018) CNN      | 6,603,710 (62 classes)         |
"""

from __future__ import annotations

from math import prod

from torch import nn

from .config import ModelConfig, choices
from .errors import ConfigError

MODELS = choices(ModelConfig, "name")  # declared once, on the config field


class LogisticRegression(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.linear(self.flatten(x))


class TwoNN(nn.Module):
    """Two hidden layers of 200 ReLU units (McMahan et al. 2017, Section 3)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 200):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    """5x5 conv(c1) - 2x2 max-pool - 5x5 conv(c2) - 2x2 max-pool - FC(hidden) - FC(classes).

    With (32, 64, 512) this is McMahan et al. 2017's CNN; LEAF's FEMNIST CNN uses
    (32, 64, 2048). Same padding keeps 28x28 -> 14x14 -> 7x7. Softmax lives in the loss.
    """

    def __init__(self, in_channels: int, num_classes: int, c1: int = 32, c2: int = 64, hidden: int = 512):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c2 * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a model by name for data of ``input_shape``; a mismatch is a ConfigError."""
    if name == "logreg":
        return LogisticRegression(prod(input_shape), num_classes)
    if name == "2nn":
        return TwoNN(prod(input_shape), num_classes)
    if name in ("cnn", "femnist_cnn"):
        if len(input_shape) != 3 or tuple(input_shape[1:]) != (28, 28):
            raise ConfigError(
                f"model.name = {name!r} needs 28x28 images, but the dataset gives inputs of shape "
                f"{tuple(input_shape)}; use logreg or 2nn for this dataset"
            )
        hidden = 512 if name == "cnn" else 2048
        return ConvNet(input_shape[0], num_classes, hidden=hidden)
    raise ConfigError(f"model.name = {name!r} is not one of {', '.join(MODELS)}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
