"""One comparison rule for the safety net and ``fxpipe verify`` (Note [one comparison rule]), and verify's
table shows the two sides of it."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from fxpipe.codegen.check.equivalence import (
    ATOL,
    RTOL,
    ModeComparison,
    compare_in_mode,
    compare_tensor,
)
from fxpipe.codegen.check.verify import VerifyReport, print_verify_report


class _SplitSum(nn.Module):
    """The reference ``nn.Linear``'s parameters, its matmul summed in two halves: float32 noise, no error."""

    def __init__(self, ref: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = ref.weight, ref.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[1] // 2
        return x[:, :h] @ self.weight[:, :h].t() + x[:, h:] @ self.weight[:, h:].t() + self.bias


def _noisy_pair() -> tuple[nn.Linear, _SplitSum, torch.Tensor]:
    torch.manual_seed(0)
    ref = nn.Linear(1024, 64)
    with torch.no_grad():
        ref.weight.mul_(30)
    return ref, _SplitSum(ref), torch.randn(64, 1024) * 10


def test_summation_order_noise_is_not_a_mismatch() -> None:
    """Outputs of magnitude ~700 differ by ~1e-4 (a relative error of 3e-7) on elements near zero too: the
    element-wise rule called that a MISMATCH, as verify did on a transformers build (issue 35, item 6)."""
    ref, pipe, x = _noisy_pair()
    result = compare_in_mode(ref, pipe, [pipe], lambda m: m(x), training=True)
    out = result.outputs[0]
    assert out.max_abs > 0 and out.max_rel < 1e-6
    assert result.ok, result.rows


def test_a_real_error_is_still_a_mismatch() -> None:
    want = torch.randn(32, 32) * 100
    got = want.clone()
    got[3, 4] += 0.05 * float(want.abs().max())
    assert not compare_tensor("t", got, want).ok
    assert not compare_tensor("t", torch.full((3,), float("nan")), torch.zeros(3)).ok
    assert compare_tensor(
        "t", torch.tensor([float("inf"), 1.0]), torch.tensor([float("inf"), 1.0])
    ).ok
    assert not compare_tensor(
        "t", torch.tensor([float("inf"), 1.0]), torch.tensor([-float("inf"), 1.0])
    ).ok


@pytest.mark.parametrize("delta", [0.0, 1e-7, 1e-5, 9e-3, 1.1e-2, 1.0])
def test_the_verdict_is_the_shown_quantity(delta: float) -> None:
    want = torch.linspace(-100.0, 100.0, 101)
    got = want.clone()
    got[50] += delta  # the element at 0
    e = compare_tensor("t", got, want)
    assert e.allowed == pytest.approx(ATOL + RTOL * 100.0)
    assert e.ok == (e.max_abs <= e.allowed)
    assert e.max_rel == pytest.approx(e.max_abs / 100.0)


def test_verify_table_prints_the_allowed_error() -> None:
    from rich.console import Console

    ref, pipe, x = _noisy_pair()
    mode = compare_in_mode(ref, pipe, [pipe], lambda m: m(x), training=True)
    report = VerifyReport(
        modes=(mode, ModeComparison(training=False, outputs=mode.outputs, grads=mode.grads)),
        rtol=RTOL,
        atol=ATOL,
        loss="weighted sum of the outputs",
    )
    buf = io.StringIO()
    print_verify_report(report, console=Console(file=buf, width=200))
    printed = buf.getvalue()
    assert "allowed" in printed and "MISMATCH" not in printed
    row = next(line for line in printed.splitlines() if "output[0]" in line)
    shown = [c.strip() for c in row.split("│") if c.strip()]
    assert float(shown[1]) <= float(shown[2]) and shown[-1] == "ok"
