"""A MobileNetV3-style network: hardswish, SE with hardsigmoid, depthwise convs, residual adds."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class SE(nn.Module):
    def __init__(self, c, r=4):
        super().__init__()
        self.fc1 = nn.Conv2d(c, c // r, 1)
        self.fc2 = nn.Conv2d(c // r, c, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        s = F.hardsigmoid(self.fc2(F.relu(self.fc1(s), inplace=True)), inplace=True)
        return x * s


class Block(nn.Module):
    def __init__(self, cin, exp, cout, k, stride, se, act):
        super().__init__()
        self.use_res = stride == 1 and cin == cout
        layers = [
            nn.Conv2d(cin, exp, 1, bias=False),
            nn.BatchNorm2d(exp, eps=0.001, momentum=0.01),
            act(inplace=True),
            nn.Conv2d(exp, exp, k, stride, k // 2, groups=exp, bias=False),
            nn.BatchNorm2d(exp, eps=0.001, momentum=0.01),
            act(inplace=True),
        ]
        if se:
            layers.append(SE(exp))
        layers += [
            nn.Conv2d(exp, cout, 1, bias=False),
            nn.BatchNorm2d(cout, eps=0.001, momentum=0.01),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        if self.use_res:
            y = y + x
        return y


class MobileNetV3(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(inplace=True)
        )
        cfg = [
            (16, 16, 16, 3, 2, True, nn.ReLU),
            (16, 64, 24, 3, 2, False, nn.ReLU),
            (24, 72, 24, 3, 1, False, nn.ReLU),
            (24, 96, 40, 5, 2, True, nn.Hardswish),
            (40, 120, 40, 5, 1, True, nn.Hardswish),
        ]
        self.features = nn.Sequential(*[Block(*c) for c in cfg])
        self.head = nn.Sequential(
            nn.Linear(40, 64),
            nn.Hardswish(inplace=True),
            nn.Dropout(0.2, inplace=True),
            nn.Linear(64, 10),
        )

    def forward(self, x):
        x = self.features(self.stem(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return MobileNetV3()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 64, 64, generator=torch.Generator().manual_seed(1)),)
