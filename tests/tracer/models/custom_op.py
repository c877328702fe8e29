"""A model that calls a custom operator defined in this file with ``torch.library.custom_op``:
a fresh process that imports a stage file must register it before the stage runs."""

import torch
import torch.nn as nn


@torch.library.custom_op("fxpipe_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
    (y,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - (y / ctx.scale) ** 2), None


def _setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.ops.fxpipe_test.scaled_tanh(layer(x), 2.0)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(1)),)
