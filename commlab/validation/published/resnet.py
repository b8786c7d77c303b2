"""The ResNet and ResNeXt image classifiers of He et al. (2016) and Xie et al. (2017), built in torch.

Published DDP measurements are of these networks as torchvision builds them; torchvision is an
optional extra, so the held-out rows count FLOPs and gradient sizes on this definition instead
(commlab/costmodel/hardware/flops.py counts it on the meta device). It registers its modules in
torchvision's order (stem, four stages of bottleneck blocks, pooling, classifier), so that the
parameters, and with them DDP's buckets, come in the same order and sizes: ResNet50 has
25,557,032 parameters, as torchvision's model card states.
"""

from __future__ import annotations

from torch import nn

# blocks per stage (He et al., Table 1)
DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


class Bottleneck(nn.Module):
    """1x1 down, 3x3 (grouped, for ResNeXt) at the stride, 1x1 up to 4x the stage's planes; a
    projection on the shortcut where the shape changes."""

    def __init__(self, inplanes: int, planes: int, stride: int, groups: int, width_per_group: int):
        super().__init__()
        width = planes * width_per_group // 64 * groups
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * 4:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes * 4))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    """A bottleneck ResNet on 224 x 224 RGB images (``input_shape``), 1000 classes."""

    input_shape = (3, 224, 224)

    def __init__(self, depth: int = 50, groups: int = 1, width_per_group: int = 64, classes: int = 1000):
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"depth must be one of {sorted(DEPTHS)}, got {depth}")
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for stage, blocks in enumerate(DEPTHS[depth]):
            planes = 64 * 2 ** stage
            layers = []
            for b in range(blocks):
                layers.append(Bottleneck(inplanes, planes, 2 if b == 0 and stage > 0 else 1, groups, width_per_group))
                inplanes = planes * 4
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet(depth: int = 50, groups: int = 1, width_per_group: int = 64) -> ResNet:
    """The factory ``--model commlab.validation.published.resnet:resnet`` names: ResNet50 by
    default; ``groups=32,width_per_group=4`` gives ResNeXt50-32x4d."""
    return ResNet(depth, groups, width_per_group)
