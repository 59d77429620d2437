"""ResNet backbones: tiny torchvision-style ResNets for the mini scale, and FedHPL's pixel-pad prompt adapter.

FedHPL (CNN) (spec fedhpl §1.3) learns pixels *concatenated around* the normalised image and runs the
enlarged image through a frozen ResNet; the pooled feature (512 for ResNet18/34, 2048 for ResNet50) goes to a
linear head. ``PromptedResNet`` works on torchvision's ``ResNet`` (headless, ``fc = Identity``) and on
``MiniResNet`` alike: both have torchvision's module names (conv1, bn1, layer1..layer4, avgpool, fc).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution, padding 1, no bias."""
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias."""
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


# torchvision's BasicBlock and Bottleneck, written out with the same module names and construction order (so
# the same seed gives the same weights; tests/test_resnet.py checks it) because importing torchvision.models
# costs a job ~1.7 s of CPU (it imports torchvision.ops and with it torch._dynamo).
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))."""
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a residual connection (ResNet-50; torchvision V1.5)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        """The bottleneck path plus the shortcut, then ReLU."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)


BLOCKS: dict[str, type[nn.Module]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


class MiniResNet(nn.Module):
    """A headless torchvision-style ResNet for 16-px images: a 3x3 stride-2 stem, no max-pool, width w..8w.

    The stride-2 stem puts the four stages at 8, 4, 2 and 1 px for a 16-px input: the same grids a
    torchvision ResNet (7x7/2 stem + max-pool) has on the 32-px CIFAR images FedHPL feeds it. It is also 2-3x
    cheaper on CPU than a stride-1 stem. The blocks are torchvision's BasicBlock / Bottleneck (written out below), so the
    Bottleneck net's feature dim is 4x the BasicBlock one's, as ResNet-50's 2048 is to ResNet-18's 512.
    """

    def __init__(self, block: str = "basic", layers: tuple[int, ...] = (1, 1, 1, 1), width: int = 16) -> None:
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"block must be one of {sorted(BLOCKS)}, got {block!r}")
        if len(layers) != 4:
            raise ValueError(f"layers must give 4 stage depths, got {layers}")
        blk = BLOCKS[block]
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()  # kept for torchvision's module layout; 16 px leaves nothing to pool
        self.layer1 = self._make_layer(blk, width, layers[0], stride=1)
        self.layer2 = self._make_layer(blk, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(blk, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(blk, 8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Identity()  # headless, like a built torchvision backbone
        self.num_features = 8 * width * blk.expansion
        # torchvision's ResNet init (zero_init_residual=False)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block: type[nn.Module], planes: int, blocks: int, stride: int) -> nn.Sequential:
        """One stage as torchvision builds it: a projection shortcut where the shape changes."""
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Pooled features (B, num_features) of a (B,3,H,W) model input."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class StemResNet(nn.Module):
    """A headless torchvision ResNet of BasicBlocks with any number of stages: torchvision's 7x7 stride-2 stem and
    3x3 stride-2 max-pool, then one stage per width (the first at stride 1, the rest at stride 2).

    FedPFT's extractors (spec fedpft §1.2, the authors' framework): ResNet-8 = stages (1, 1, 1) of widths
    (64, 128, 256), ResNet-10 = (1, 1, 1, 1) of (64, 128, 256, 512), trained from scratch; the ImageNet stem is kept
    even on 32-px CIFAR images (Table 10's parameter counts need it: a 3x3 stem gives 1.23 M, not 1.24 M).
    """

    def __init__(self, layers: tuple[int, ...] = (1, 1, 1), widths: tuple[int, ...] = (64, 128, 256)) -> None:
        super().__init__()
        if len(layers) != len(widths) or not layers:
            raise ValueError(f"layers {layers} and widths {widths} must give one depth per stage")
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        for i, (depth, width) in enumerate(zip(layers, widths)):
            setattr(self, f"layer{i + 1}", self._make_layer(width, depth, stride=1 if i == 0 else 2))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Identity()  # headless: methods add their own heads
        self.num_features = widths[-1]
        for m in self.modules():  # torchvision's ResNet init (zero_init_residual=False)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        """One stage of BasicBlocks, torchvision's construction order."""
        return MiniResNet._make_layer(self, BasicBlock, planes, blocks, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Pooled features (B, num_features) of a (B,3,H,W) model input."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in resnet_stages(self):
            x = stage(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet_stages(model: nn.Module) -> list[nn.Module]:
    """The residual stages layer1, layer2, ... of a torchvision-style ResNet."""
    stages = []
    while hasattr(model, f"layer{len(stages) + 1}"):
        stages.append(getattr(model, f"layer{len(stages) + 1}"))
    return stages


def resnet_feature_dim(model: nn.Module) -> int:
    """Channels of the last stage's output (the pooled feature dim), read from its last block."""
    last = resnet_stages(model)[-1][-1]
    return int((last.bn3 if hasattr(last, "bn3") else last.bn2).num_features)


class PixelPadPrompt(nn.Module):
    """FedHPL's image-space prompt: learnable pixels concatenated around a (B,3,s,s) normalised image.

    ``prompt_lr`` holds the left and right strips (2, 3, s, w); ``prompt_tb`` the top and bottom strips
    (2, 3, w, s+2w), which span the widened image. The result is (B, 3, s+2w, s+2w); no input pixel is
    overwritten. 2·3·s·w + 2·3·w·(s+2w) parameters: 1260 at s=32, w=3 and 8172 at s=224, w=3 (Table 8).
    """

    def __init__(self, img_size: int, width: int = 3, channels: int = 3, init: str = "zeros", std: float = 0.02,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"pad width must be >= 1, got {width}")
        s, w = int(img_size), int(width)
        self.img_size, self.width = s, w
        self.prompt_lr = nn.Parameter(torch.zeros(2, channels, s, w))
        self.prompt_tb = nn.Parameter(torch.zeros(2, channels, w, s + 2 * w))
        if init == "normal":  # the spec's alternative: N(0, 0.02²) in normalised-pixel space
            with torch.no_grad():
                self.prompt_lr.normal_(0.0, std, generator=generator)
                self.prompt_tb.normal_(0.0, std, generator=generator)
        elif init != "zeros":
            raise ValueError(f"init must be 'zeros' or 'normal', got {init!r}")

    @property
    def out_size(self) -> int:
        """Side of the padded image, s + 2w."""
        return self.img_size + 2 * self.width

    def forward(self, x: Tensor) -> Tensor:
        """(B,C,s,s) -> (B,C,s+2w,s+2w): [left | x | right], then top above and bottom below."""
        b, _, h, w = x.shape
        if (h, w) != (self.img_size, self.img_size):
            raise ValueError(f"PixelPadPrompt expects {self.img_size}x{self.img_size} inputs, got {h}x{w}")
        # under autocast the image may be bf16 while the prompts are fp32: match the image
        lr, tb = self.prompt_lr.to(x.dtype), self.prompt_tb.to(x.dtype)
        x = torch.cat([lr[0].expand(b, -1, -1, -1), x, lr[1].expand(b, -1, -1, -1)], dim=3)
        return torch.cat([tb[0].expand(b, -1, -1, -1), x, tb[1].expand(b, -1, -1, -1)], dim=2)


class PromptedResNet(nn.Module):
    """Wrap a frozen torchvision-style ResNet (always in eval mode) and run it on optionally pixel-padded inputs."""

    def __init__(self, resnet: nn.Module) -> None:
        super().__init__()
        if not resnet_stages(resnet):
            raise TypeError(f"{type(resnet).__name__} has no layer1..layerN stages: not a torchvision-style ResNet")
        if not isinstance(getattr(resnet, "fc", None), nn.Identity):
            raise ValueError("the ResNet must be headless (fc = Identity), as build_backbone returns it")
        self.resnet = resnet
        resnet.requires_grad_(False)
        resnet.eval()
        self.feature_dim = resnet_feature_dim(resnet)
        self.depth = len(resnet_stages(resnet))
        pcfg = getattr(resnet, "pretrained_cfg", None) or {}
        self.img_size = int(pcfg["input_size"][-1]) if "input_size" in pcfg else None

    def train(self, mode: bool = True) -> "PromptedResNet":
        """Switch the wrapper's own modules; the backbone stays in eval mode (BatchNorm uses its running stats)."""
        super().train(mode)
        self.resnet.eval()
        return self

    def make_pad_prompt(self, width: int = 3, init: str = "zeros",
                        generator: torch.Generator | None = None) -> PixelPadPrompt:
        """A PixelPadPrompt sized for this backbone's input (its pretrained config's image size)."""
        if self.img_size is None:
            raise ValueError("the backbone carries no input size: build it with build_backbone or size the prompt")
        return PixelPadPrompt(self.img_size, width, init=init, generator=generator)

    def forward(self, x: Tensor, pad: PixelPadPrompt | None = None) -> Tensor:
        """Pooled features (B, feature_dim) of model input `x`, padded by `pad` first when given."""
        return self.resnet(x if pad is None else pad(x))
