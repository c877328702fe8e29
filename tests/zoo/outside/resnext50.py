"""A new user's ResNet-50-style network (ResNeXt bottlenecks, stride on the 3x3, downsample, zero-init residual BN)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64):
        super().__init__()
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNeXt(nn.Module):
    def __init__(self, layers=(2, 2, 2, 1), groups=4, width_per_group=8, num_classes=10):
        super().__init__()
        self.inplanes = 16
        self.groups, self.base_width = groups, width_per_group
        self.conv1 = nn.Conv2d(3, 16, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(8, layers[0])
        self.layer2 = self._make_layer(16, layers[1], stride=2)
        self.layer3 = self._make_layer(32, layers[2], stride=2)
        self.layer4 = self._make_layer(64, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(64 * 4, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if isinstance(m, Bottleneck):
                nn.init.constant_(m.bn3.weight, 0.5)

    def _make_layer(self, planes, blocks, stride=1):
        downsample = None
        if stride != 1 or self.inplanes != planes * 4:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False),
                nn.BatchNorm2d(planes * 4),
            )
        layers = [
            Bottleneck(self.inplanes, planes, stride, downsample, self.groups, self.base_width)
        ]
        self.inplanes = planes * 4
        for _ in range(1, blocks):
            layers.append(
                Bottleneck(self.inplanes, planes, groups=self.groups, base_width=self.base_width)
            )
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


def build_model():
    torch.manual_seed(0)
    return ResNeXt()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 64, 64, generator=torch.Generator().manual_seed(1)),)


def example_targets(batch_size):
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
