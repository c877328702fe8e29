"""Note [one mode is enough]: the eval-mode trace is skipped only when both modes make the same calls."""

from __future__ import annotations

import torch
import torch.nn as nn

import fxpipe.tracer.api as tracer_api
from fxpipe.tracer import trace_model
from fxpipe.tracer.train_eval.mode_probe import modes_compute_alike
from fxpipe.tracer.train_eval.modes import run_in_mode


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class WithDropout(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.dropout(self.a(x), 0.1, self.training))


class WithZeroDropout(Plain):
    """p=0 dropout, as transformers configure it: no random call in either mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.dropout(self.a(x), 0.0, self.training))


class WithBatchNorm(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


class BatchStatisticsOnly(Plain):
    """Batch norm without running statistics and a p=0 dropout module: one function in both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8, track_running_stats=False)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.norm(self.a(x))))


class OtherConstant(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * (2.0 if self.training else 3.0))


class OtherBuffer(Plain):
    """Same calls, same shapes; eval mode reads another buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("train_scale", torch.full((8,), 2.0))
        self.register_buffer("eval_scale", torch.full((8,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.train_scale if self.training else self.eval_scale
        return self.b(self.a(x) * scale)


class OtherPlainTensor(Plain):
    """Eval mode reads a plain tensor attribute (not a buffer) of the same shape, other values."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = {True: torch.full((8,), 2.0), False: torch.full((8,), 3.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.scales[self.training])


def _alike(model: nn.Module) -> bool:
    x = torch.randn(4, 8)
    return modes_compute_alike(model, (x,), lambda: model(x))


def test_models_that_compute_alike_in_both_modes() -> None:
    assert _alike(Plain())
    assert _alike(WithZeroDropout())
    assert _alike(BatchStatisticsOnly())


def test_any_difference_between_the_modes_is_seen() -> None:
    for cls in (WithDropout, WithBatchNorm, OtherConstant, OtherBuffer, OtherPlainTensor):
        model = cls()
        assert not _alike(model), cls.__name__
        assert model.training  # left in train mode


def test_the_trace_skips_the_eval_trace_only_when_the_modes_agree(monkeypatch) -> None:
    merged: list[str] = []
    real = tracer_api.merge_eval_mode

    def counting(model, *args, **kwargs):
        merged.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(tracer_api, "merge_eval_mode", counting)
    for cls in (Plain, OtherBuffer, WithZeroDropout):
        torch.manual_seed(0)
        model = cls()
        traced = trace_model(model, (torch.randn(4, 8),), progress=False)
        x = torch.randn(3, 8)
        for training in (True, False):  # the one graph computes each mode's function
            model.train(training)
            env = run_in_mode(traced.graph_module, (x,), training)
            out = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
            torch.testing.assert_close(env[out.args[0][0]], model(x), rtol=0, atol=0)
    # a p=0 dropout computes alike, but takes the mode: traced in both so the stage reads self.training
    assert merged == ["OtherBuffer", "WithZeroDropout"]
