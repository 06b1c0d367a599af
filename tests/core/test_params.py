import torch

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
