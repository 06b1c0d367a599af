import torch
from torch import nn

from shoal.models import build_model
from shoal.params import ParamSpec, bind_module, flatten


def test_state_dict_tensors_are_views_of_the_flat_buffer():
    model = build_model("2nn", (1, 28, 28), 10)
    before = flatten(model)
    flat, grad = bind_module(model)
    assert torch.equal(flat, before)
    flat.add_(1.0)
    for t in model.state_dict().values():
        assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(flatten(model), before + 1.0)


def test_gradients_land_in_the_flat_grad_buffer():
    model = build_model("logreg", (60,), 10)
    flat, grad = bind_module(model)
    ptr = grad.data_ptr()
    x, y = torch.randn(8, 60), torch.randint(0, 10, (8,))
    for _ in range(2):
        grad.zero_()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert grad.data_ptr() == ptr
    assert grad.abs().sum() > 0
    spec = ParamSpec.of(model)
    views = spec.views(grad)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, views[name])


def test_spec_hash_and_json_round_trip():
    a = ParamSpec.of(build_model("2nn", (1, 28, 28), 10))
    b = ParamSpec.of(build_model("2nn", (1, 28, 28), 62))
    assert a.hash != b.hash
    assert ParamSpec.from_json(a.to_json()) == a
    assert a.numel == 199_210 and a.nbytes == 4 * 199_210


def test_the_spec_hash_binds_the_frozen_parameters_that_never_travel():
    """Two ends whose exchanged tensors agree but whose frozen base weights differ must not
    exchange updates: the trainer's spec hash covers a digest of the frozen parameters."""
    from shoal.client.training import LocalTrainer
    from shoal.config import TrainConfig
    from shoal.params import frozen_digest

    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        m[0].requires_grad_(False)  # the "pretrained base"
        return m

    a, b, c = (LocalTrainer(model(s), TrainConfig()).spec for s in (0, 0, 1))
    assert a.hash == b.hash and a.base == frozen_digest(model(0)) != ""
    assert c.hash != a.hash and c.to_json() == a.to_json()  # same layout, other base
    plain = nn.Linear(4, 2)
    assert frozen_digest(plain) == "" and LocalTrainer(plain, TrainConfig()).spec.hash == ParamSpec.of(plain).hash


def test_a_node_told_of_another_base_says_so_in_one_line():
    from types import SimpleNamespace

    from shoal.client.node import Node
    from shoal.errors import SpecMismatch
    from shoal.wire import encode_model

    layer = nn.Linear(3, 2)
    spec = ParamSpec.of(layer)
    server_spec, node_spec = ParamSpec(spec.entries, "aaaa"), ParamSpec(spec.entries, "bbbb")
    body = encode_model(torch.zeros(spec.numel), server_spec, 0)
    node = SimpleNamespace(trainer=SimpleNamespace(spec=node_spec))
    line = Node._spec_mismatch(node, body, SpecMismatch("x"))  # type: ignore[arg-type]
    assert "frozen parameters differ" in line and server_spec.hash in line and node_spec.hash in line
