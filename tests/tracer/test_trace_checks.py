"""What the tracer says about the graph it made: the output check runs both sides from one seed, and
``torch._assert`` messages keep what the user wrote (fxpipe.tracer.frontend.assert_messages)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.errors import TraceError
from fxpipe.tracer import trace_model


class Noisy(nn.Module):
    def __init__(self, frozen_noise: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.frozen_noise = frozen_noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(self.drop(self.fc(x)), 0.3, training=self.training)
        if (
            self.frozen_noise
        ):  # a value the trace captures as a constant: the graph differs from the model
            y = y + torch.randn(()).item()
        return y


def _fxpipe_warnings(model: nn.Module, frontend: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace_model(model, (torch.randn(4, 8),), frontend=frontend, progress=False)
    return [str(w.message) for w in caught if "outputs differ" in str(w.message)]


def test_dropout_alone_does_not_make_the_output_check_warn() -> None:
    for frontend in ("symbolic", "export"):
        assert _fxpipe_warnings(Noisy(), frontend) == []


def test_a_real_difference_still_warns() -> None:
    assert _fxpipe_warnings(Noisy(frozen_noise=True), "symbolic")


def test_tracing_leaves_the_random_state_as_it_was() -> None:
    model, x = Noisy(), torch.randn(4, 8)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    trace_model(
        model, (x,), progress=False
    )  # seeds its own runs, then puts the caller's state back
    assert torch.equal(torch.rand(4), expected)


class Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.size = 6
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s = x.shape
        torch._assert(s == self.size, f"Wrong width! Expected {self.size} but got {s}!")
        torch._assert(x.dim() == 2, f"Expected (batch, width) got {x.shape}, {{braces}} and 100%")
        torch._assert(n > 0, "a plain message")
        return self.fc(x)


def test_assert_messages_show_what_the_user_wrote_not_proxies() -> None:
    traced = trace_model(Checked(), (torch.randn(4, 6),), frontend="symbolic", progress=False)
    messages = [n.args[1] for n in traced.graph_module.graph.nodes if n.target is torch._assert]
    assert messages == [
        "Wrong width! Expected 6 but got {s}!",
        "Expected (batch, width) got {x.shape}, {braces} and 100%",
        "a plain message",
    ]
    # the `x.shape` that only the message read is gone
    assert not [n for n in traced.graph_module.graph.nodes if n.target is getattr and not n.users]


class Cache:
    """Stands for transformers' ``Cache`` base class (``DynamicCache`` is a subclass): matched by name."""


class DynamicCache(Cache):
    def __init__(self, key: torch.Tensor) -> None:
        self.key = key


class ReturnsACache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict:
        y = self.fc(x)
        return {"logits": y, "past_key_values": DynamicCache(y)}


def test_an_output_object_that_is_not_a_tensor_is_refused_with_its_place_and_the_fix() -> None:
    with pytest.raises(
        TraceError,
        match=r"returns a DynamicCache at output\['past_key_values'\]: .*"
        r"build the model with config.use_cache=False",
    ):
        trace_model(ReturnsACache(), (torch.randn(4, 8),), progress=False)
    wrapped = nn.Sequential(nn.Linear(8, 8))
    wrapped.forward = lambda x: (wrapped[0](x), warnings)  # type: ignore[method-assign]  # a module object
    with pytest.raises(TraceError, match=r"returns a module at output\[1\]: .* return tensors"):
        trace_model(wrapped, (torch.randn(4, 8),), progress=False)
