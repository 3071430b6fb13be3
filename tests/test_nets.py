"""Model sizes match the papers, and the models are vmap-safe pure functions."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from fedharness.errors import ConfigError
from fedharness.problems.nets import (
    CNN,
    NETS,
    VGG11,
    ResNet18,
    TwoNN,
    build_net,
    count_params,
)

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def _vgg11_cifar_params() -> int:
    """VGG-11 on 3x32x32 by hand: 3x3 convs (k*k*c_in*c_out + c_out) and the classifier."""
    widths = [3, 64, 128, 256, 256, 512, 512, 512, 512]
    convs = sum(9 * a * b + b for a, b in zip(widths[:-1], widths[1:]))
    assert convs == 9_220_480
    classifier = (512 * 512 + 512) * 2 + (512 * 10 + 10)
    return convs + classifier


@pytest.mark.parametrize(
    ("name", "in_shape", "expected"),
    [
        ("2nn", (1, 28, 28), 199_210),
        ("2nn", (784,), 199_210),
        ("cnn", (1, 28, 28), 582_026),
        ("vgg11", (3, 32, 32), 9_750_922),
        ("resnet18", (3, 32, 32), 11_173_962),
    ],
)
def test_param_counts_match_papers(name, in_shape, expected):
    assert count_params(build_net(name, in_shape, 10)) == expected


def test_vgg11_count_is_the_hand_formula():
    assert _vgg11_cifar_params() == 9_750_922
    assert count_params(VGG11()) == _vgg11_cifar_params()


def test_default_constructors_match_build_net():
    assert count_params(TwoNN()) == 199_210
    assert count_params(CNN()) == 582_026
    assert count_params(ResNet18()) == 11_173_962


@pytest.mark.parametrize(
    ("name", "in_shape"),
    [
        ("2nn", (1, 28, 28)),
        ("cnn", (1, 28, 28)),
        ("cnn", (3, 32, 32)),
        ("vgg11", (3, 32, 32)),
        ("resnet18", (3, 32, 32)),
        ("resnet18", (1, 28, 28)),
    ],
)
def test_output_shapes(name, in_shape):
    torch.manual_seed(0)
    model = build_net(name, in_shape, 7)
    out = model(torch.randn(4, *in_shape))
    assert out.shape == (4, 7)
    assert torch.isfinite(out).all()


def test_2nn_accepts_flat_and_image_inputs():
    torch.manual_seed(0)
    model = TwoNN()
    x = torch.randn(5, 1, 28, 28)
    torch.testing.assert_close(model(x), model(x.reshape(5, 784)))


@pytest.mark.parametrize("name", sorted(set(NETS) - {"resnet18_bn"}))  # resnet18_bn: tests/test_any_model.py
def test_no_batchnorm_no_dropout_no_buffers(name):
    in_shape = (1, 28, 28) if name in ("2nn", "cnn") else (3, 32, 32)
    model = build_net(name, in_shape, 10)
    banned = (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.Dropout2d)
    assert not [m for m in model.modules() if isinstance(m, banned)]
    assert list(model.buffers()) == []
    # No module may modify its input in place (it would break vmap/grad).
    assert not [m for m in model.modules() if getattr(m, "inplace", False)]


def _vmap_matches_loop(name: str, in_shape: tuple[int, ...], copies: int = 3) -> None:
    torch.manual_seed(0)
    models = [build_net(name, in_shape, 10) for _ in range(copies)]
    params, buffers = stack_module_state(models)
    assert buffers == {}
    base = build_net(name, in_shape, 10).to("meta")
    x = torch.randn(copies, 6, *in_shape)  # each copy sees its own batch

    def run(p: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
        return functional_call(base, p, (xb,))

    batched = vmap(run)(params, x)
    looped = torch.stack([m(xb) for m, xb in zip(models, x)])
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["2nn", "cnn"])
def test_vmap_over_stacked_params_equals_separate_runs(name):
    _vmap_matches_loop(name, (1, 28, 28))


def test_vmap_works_through_groupnorm():
    # ResNet-18's GroupNorm must batch under vmap too (small images keep it fast).
    _vmap_matches_loop("resnet18", (3, 8, 8), copies=2)


def test_vmap_grad_over_stacked_params():
    # The engine differentiates per client; grads through vmap equal per-copy grads.
    torch.manual_seed(0)
    models = [build_net("cnn", (1, 28, 28), 10) for _ in range(3)]
    params, _ = stack_module_state(models)
    base = build_net("cnn", (1, 28, 28), 10).to("meta")
    x = torch.randn(3, 4, 1, 28, 28)
    y = torch.randint(0, 10, (3, 4))

    def loss(p, xb, yb):
        return nn.functional.cross_entropy(functional_call(base, p, (xb,)), yb)

    grads = vmap(torch.func.grad(loss))(params, x, y)
    for i, model in enumerate(models):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i]), y[i]).backward()
        for key, p in model.named_parameters():
            torch.testing.assert_close(grads[key][i], p.grad, atol=1e-5, rtol=1e-4)


def test_unknown_name_lists_registered_models():
    with pytest.raises(ConfigError) as err:
        build_net("lenet", (1, 28, 28), 10)
    assert err.value.key == "model"
    assert err.value.value == "lenet"
    for name in NETS:
        assert name in str(err.value)


@pytest.mark.parametrize(("name", "in_shape"), [("cnn", (1, 8, 8)), ("vgg11", (1, 8, 8)), ("cnn", (784,))])
def test_too_small_or_flat_inputs_are_config_errors(name, in_shape):
    with pytest.raises(ConfigError) as err:
        build_net(name, in_shape, 10)
    assert err.value.key == "model"
