"""Split backward (B: input gradients, W: weight gradients later) equals the fused backward, exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fxpipe.modelfile import load_model_file
from fxpipe.runtime.pipeline.split_backward import backward_inputs, backward_weights
from example_models import EXAMPLES


class Tied(nn.Module):
    """A weight used twice on the input path and a bias reached only through the weight branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        h = torch.tanh(self.b(h)) + self.a(h)  # self.a again, downstream of its first use
        return h * 2, (self.b.weight.sum() * h).mean(-1)


class NoInputPath(nn.Module):
    """A first stage: integer inputs, so every gradient is a weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 6)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(idx))


def _gpt_blocks() -> tuple[nn.Module, list[torch.Tensor]]:
    source = load_model_file(EXAMPLES["gpt"])
    model = source.build_model()
    blocks = nn.Sequential(*model.blocks) if hasattr(model, "blocks") else model
    x = (
        torch.randn(2, 8, model.wte.weight.shape[1])
        if hasattr(model, "wte")
        else torch.randn(2, 8, 32)
    )
    return blocks, [x]


def _cases() -> list[tuple[str, nn.Module, list[torch.Tensor]]]:
    torch.manual_seed(0)
    return [
        ("tied", Tied(), [torch.randn(4, 6)]),
        ("no input path", NoInputPath(), [torch.randint(0, 10, (3, 5))]),
        ("gpt blocks", *_gpt_blocks()),
    ]


@pytest.mark.parametrize("case", range(3), ids=["tied", "no-input-path", "gpt-blocks"])
def test_split_equals_fused_bitwise(case: int) -> None:
    name, module, inputs = _cases()[case]
    fused, split = module, copy.deepcopy(module)
    results = []
    for m, do_split in ((fused, False), (split, True)):
        grads_in = []
        for mb in range(2):  # two microbatches accumulate into .grad
            xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
            outs = m(*xs)
            outs = list(outs) if isinstance(outs, tuple) else [outs]
            seeds = [torch.full_like(o, 0.5 + mb) for o in outs]
            leaves = [x for x in xs if x.requires_grad]
            params = [p for p in m.parameters() if p.requires_grad]
            if do_split:
                got, work = backward_inputs(outs, seeds, leaves, params)
                assert all(p.grad is None or mb > 0 for p in params)  # B leaves the weights alone
                backward_weights(work)
                grads_in.append(got)
            else:
                torch.autograd.backward(outs, seeds)
                grads_in.append([x.grad for x in leaves])
        results.append((grads_in, {k: p.grad for k, p in m.named_parameters()}))
    (fused_in, fused_w), (split_in, split_w) = results
    for a, b in zip(fused_in, split_in):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"{name}: input gradient differs"
    assert fused_w.keys() == split_w.keys()
    for k in fused_w:
        assert torch.equal(fused_w[k], split_w[k]), (
            f"{name}: {k} differs by {(fused_w[k] - split_w[k]).abs().max()}"
        )


def test_b_runs_the_input_path_only_and_w_the_weight_branches() -> None:
    """B must not compute weight gradients (that is the point of the split): count the matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    out = lin(x)
    with FlopCounterMode(display=False) as total:
        torch.autograd.grad(
            out, [x] + list(lin.parameters()), torch.ones_like(out), retain_graph=True
        )
    params = list(lin.parameters())
    with FlopCounterMode(display=False) as b_pass:
        _, work = backward_inputs([out], [torch.ones_like(out)], [x], params)
    with FlopCounterMode(display=False) as w_pass:
        backward_weights(work)
    assert b_pass.get_total_flops() + w_pass.get_total_flops() == total.get_total_flops()
    assert b_pass.get_total_flops() == w_pass.get_total_flops() == total.get_total_flops() // 2
