"""The profile's activation bytes (Note [saved once] in fxpipe.tracer.measure.counting) against a measurement."""

from __future__ import annotations

import torch
import torch.nn as nn

from fxpipe.runtime.pipeline.peak_memory import TensorMemoryTracker, state_tensors
from fxpipe.tracer import trace_model


def _saved_by_one_forward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes that one forward keeps alive for backward (its autograd graph lives as long as the
    output), the input included as the profile counts it; the model's last op saves its output."""
    with TensorMemoryTracker(state_tensors(model) + [x]) as tracker:
        out = model(x)
        held = tracker.live_bytes
    del out
    return held - sum(t.untyped_storage().nbytes() for t in state_tensors(model))


def test_a_tensor_saved_by_its_producer_and_its_consumer_counts_once() -> None:
    torch.manual_seed(0)
    # ReLU and Tanh save their outputs, and the Linear after each saves the same tensor as its
    # input: charged to both units, the profile counted 5 such tensors where 3 are held.
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU()
    )
    x = torch.randn(64, 8)
    profile = trace_model(model, (x,)).profile
    held = _saved_by_one_forward(model, x)
    assert sum(u.activation_bytes for u in profile.units) == held
    per_tensor = 64 * 32 * 4
    assert held == 64 * 8 * 4 + 3 * per_tensor  # x, relu out, tanh out, last relu out


def test_activation_bytes_of_in_place_relus_match_a_measurement() -> None:
    # Note [saved once] maps saved storages to input nodes through the copies a unit runs on: each
    # in-place ReLU saves its output (the Linear's output storage) and the next Linear saves it again
    model = nn.Sequential(
        nn.Linear(8, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 32),
        nn.ReLU(inplace=True),
    )
    x = torch.randn(64, 8)
    profile = trace_model(model, (x,), progress=False).profile
    held = _saved_by_one_forward(model, x)
    assert sum(u.activation_bytes for u in profile.units) == held == 64 * 8 * 4 + 3 * 64 * 32 * 4
