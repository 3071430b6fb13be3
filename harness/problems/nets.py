"""Neural networks used by the paper reproductions.

The engine trains many clients at once with ``torch.func.vmap`` +
``functional_call`` over stacked parameters and buffers (problems/module_state.py):
BatchNorm's running statistics are part of each client copy's state and dropout
masks come from the run's random streams. Parameter counts match the papers
(see PAPERS.md):

* ``TwoNN``    784-200-200-10 MLP (Yang et al.)            199,210 params
* ``CNN``      conv5x5x32-pool-conv5x5x64-pool-fc512-fc10   582,026 on MNIST
* ``FemnistCNN`` LEAF's FEMNIST CNN: the same with "same" padding and fc2048, 62 classes   6,603,710 on FEMNIST
* ``VGG11``    VGG-11 without batch norm (FedNova)        9,750,922 on CIFAR-10
* ``ResNet18`` CIFAR ResNet-18, GroupNorm for BatchNorm  11,173,962 on CIFAR-10
* ``ResNet18`` with ``norm="batch"`` (``resnet18_bn``): the same with BatchNorm, the default network of most
  federated-learning papers; the same parameter count, plus 9,600 running statistics
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedharness.errors import ConfigError, require
from fedharness.problems.objectives import BUFFERS, L2
from fedharness.registry.groups import MODELS


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


class TwoNN(nn.Module):
    """Two hidden layers of ReLU units (McMahan et al.'s "2NN")."""

    head_module = "fc3"  # the head (FedRep, FedBABU): the last layer

    def __init__(self, in_features: int = 784, hidden: int = 200, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Accepts [B, 784] as well as [B, 1, 28, 28].
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def _cnn_out(size: int) -> int:
    # Unpadded ("valid") 5x5 convs: 28 -> 24 -> 12 -> 8 -> 4. Only valid padding
    # gives Yang et al.'s 582,026 params (64*4*4*512 + 512 = 524,800 for fc1);
    # "same" padding would leave 7x7 maps and 1.66M params.
    return ((size - 4) // 2 - 4) // 2


class CNN(nn.Module):
    """conv5x5x32 - relu - pool2 - conv5x5x64 - relu - pool2 - fc512 - relu - fc."""

    head_module = "fc2"  # the head (FedRep, FedBABU): the last layer

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int | tuple[int, int] = 28,
        num_classes: int = 10,
    ):
        super().__init__()
        h, w = (_cnn_out(s) for s in _pair(image_size))
        if h < 1 or w < 1:
            raise ConfigError("model", "cnn", f"images of at least 16x16, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.fc1 = nn.Linear(64 * h * w, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class FemnistCNN(nn.Module):
    """LEAF's FEMNIST CNN (femnist/cnn.py): conv5x5x32 "same" - relu - pool2 - conv5x5x64 "same" - relu - pool2 -
    fc2048 - relu - fc. On 28x28 the maps are 14x14 then 7x7, so fc2048 has 7*7*64 inputs."""

    head_module = "fc2"  # the head (FedRep, FedBABU): the last layer

    def __init__(self, in_channels: int = 1, image_size: int | tuple[int, int] = 28, num_classes: int = 62):
        super().__init__()
        h, w = (s // 4 for s in _pair(image_size))  # two 2x2 pools; "same" convs keep the size
        if h < 1 or w < 1:
            raise ConfigError("model", "femnist_cnn", f"images of at least 4x4, got {image_size}")
        self.shape = (in_channels, *_pair(image_size))
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=2)
        self.fc1 = nn.Linear(64 * h * w, 2048)
        self.fc2 = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, *self.shape)  # LEAF's samples are flat 784-vectors
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


VGG11_CONFIG: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG11(nn.Module):
    """VGG-11 without batch norm, classifier as in FedNova's code minus dropout."""

    head_module = "classifier.4"  # the head (FedRep, FedBABU): the last layer

    def __init__(
        self,
        in_channels: int = 3,
        image_size: int | tuple[int, int] = 32,
        num_classes: int = 10,
    ):
        super().__init__()
        h, w = (s // 32 for s in _pair(image_size))  # five 2x2 max-pools
        if h < 1 or w < 1:
            raise ConfigError("model", "vgg11", f"images of at least 32x32, got {image_size}")
        layers: list[nn.Module] = []
        channels = in_channels
        for item in VGG11_CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, int(item), kernel_size=3, padding=1), nn.ReLU()]
                channels = int(item)
        self.features = nn.Sequential(*layers)
        # On 32x32 inputs the feature map is 512x1x1, as FedNova's Linear(512, 512) expects.
        self.classifier = nn.Sequential(
            nn.Linear(512 * h * w, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def _norm(channels: int, groups: int) -> nn.Module:
    # GroupNorm has BatchNorm's 2*C affine params but no running statistics, so
    # the model stays a pure function of its parameters and the parameter count
    # matches the BatchNorm ResNet-18 the papers report. groups=0: BatchNorm.
    if groups == 0:
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(groups, channels), channels)


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (1x1 conv shortcut on shape change)."""

    def __init__(self, in_planes: int, planes: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(planes, groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.norm2 = _norm(planes, groups)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                _norm(planes, groups),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18 (3x3 stem, no stem pooling), kuangliu layout.

    ``norm_groups=2`` follows the federated-learning practice of GroupNorm with
    two groups (Hsieh et al. 2020; Reddi et al. 2021); ``norm="batch"`` puts
    BatchNorm in its place (kuangliu's original).
    """

    head_module = "linear"  # the head (FedRep, FedBABU): the last layer

    def __init__(self, in_channels: int = 3, num_classes: int = 10, norm_groups: int = 2, norm: str = "group"):
        super().__init__()
        require(norm in ("group", "batch"), "model", norm, "a ResNet18 norm: group | batch")
        norm_groups = 0 if norm == "batch" else norm_groups
        self.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        self.norm1 = _norm(64, norm_groups)
        blocks: list[nn.Module] = []
        in_planes = 64
        for planes, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            for block_stride in (stride, 1):
                blocks.append(BasicBlock(in_planes, planes, block_stride, norm_groups))
                in_planes = planes
        self.layers = nn.Sequential(*blocks)
        self.linear = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.layers(out)
        # Global average pooling: equals kuangliu's avg_pool2d(4) on 32x32 inputs
        # and also works on other image sizes.
        return self.linear(out.mean(dim=(2, 3)))


def _build_2nn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return TwoNN(in_features=math.prod(in_shape), num_classes=num_classes)


def _image_shape(name: str, in_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(in_shape) != 3:
        raise ConfigError("model", name, f"image input of shape (C, H, W), got {tuple(in_shape)}")
    c, h, w = (int(s) for s in in_shape)
    return c, h, w


def _build_cnn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = _image_shape("cnn", in_shape)
    return CNN(in_channels=c, image_size=(h, w), num_classes=num_classes)


def _build_femnist_cnn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    side = math.isqrt(int(in_shape[0])) if len(in_shape) == 1 else 0
    if side and side * side == in_shape[0]:  # a flat square image, as LEAF's JSON holds them
        return FemnistCNN(in_channels=1, image_size=side, num_classes=num_classes)
    c, h, w = _image_shape("femnist_cnn", in_shape)
    return FemnistCNN(in_channels=c, image_size=(h, w), num_classes=num_classes)


def _build_vgg11(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = _image_shape("vgg11", in_shape)
    return VGG11(in_channels=c, image_size=(h, w), num_classes=num_classes)


def _build_resnet18(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, _, _ = _image_shape("resnet18", in_shape)
    return ResNet18(in_channels=c, num_classes=num_classes)


def _build_resnet18_bn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, _, _ = _image_shape("resnet18_bn", in_shape)
    return ResNet18(in_channels=c, num_classes=num_classes, norm="batch")


NETS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "2nn": _build_2nn,
    "cnn": _build_cnn,
    "femnist_cnn": _build_femnist_cnn,
    "vgg11": _build_vgg11,
    "resnet18": _build_resnet18,
    "resnet18_bn": _build_resnet18_bn,
}  # the built-in nets; a model's factory returns an nn.Module, which problems.build_problem makes a NetObjective
for _name, _build in NETS.items():  # their keys: l2, and buffers where BatchNorm keeps statistics
    MODELS.add(_name, _build, {"l2": L2, "buffers": BUFFERS} if _name == "resnet18_bn" else {"l2": L2})


def require_net(name: str, made: Any) -> nn.Module:
    """What a net's factory returned, refused unless it is a torch nn.Module."""
    require(isinstance(made, nn.Module), "model", name, f"its factory must return a torch nn.Module, got {type(made)}")
    return made


def build_net(name: str, in_shape: tuple[int, ...], num_classes: int, **params) -> nn.Module:
    """The registered network `name` (built-in or a user's) for inputs of shape `in_shape` (no batch dim);
    `params` are the model config's own keys (built-in nets have none)."""
    return require_net(name, MODELS.build(name, params, {"in_shape": tuple(in_shape), "num_classes": num_classes}))


def count_params(model: nn.Module) -> int:
    """Number of scalar parameters (the model size the papers report)."""
    return sum(p.numel() for p in model.parameters())
