"""Peak tensor memory: the CPU tracker itself, and the plan's stage memory against a real run."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn as nn

from fxpipe.codegen import write_build_dir
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.partitioner.prediction import RUNTIME_COSTS
from fxpipe.runtime.pipeline.comm import pairs_sends
from fxpipe.runtime.launch.launcher import run_build
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.pipeline.peak_memory import (
    TensorMemoryTracker,
    peak_tensor_bytes,
    state_tensors,
)
from fxpipe.tracer import trace_model_file

KIB = 1024


@pytest.mark.parametrize("device", sorted(RUNTIME_COSTS))
def test_memory_model_posts_receives_as_the_runtime_does(device: str) -> None:
    # the runtime posts every receive at the step's start exactly where it does not pair sends (gloo),
    # and the memory model counts one receive buffer per message there (Note [memory over time])
    assert RUNTIME_COSTS[device].step_receives is (not pairs_sends(torch.device(device)))


def test_tracker_counts_each_storage_once_until_freed() -> None:
    w = torch.zeros(256)  # 1 KiB
    with TensorMemoryTracker([w, w.view(16, 16)]) as tracker:
        assert tracker.live_bytes == KIB
        y = w + 1
        views = [y[:10], y.view(16, 16).t()]
        assert tracker.live_bytes == 2 * KIB
        del y, views
        assert tracker.live_bytes == KIB
        big = torch.ones(1024)  # 4 KiB
        del big
    assert tracker.peak_bytes == 5 * KIB and tracker.live_bytes == KIB


def test_tracker_sees_backward_and_grads() -> None:
    lin = nn.Linear(64, 64)
    x = torch.randn(512, 64)
    act = 512 * 64 * 4
    with TensorMemoryTracker(state_tensors(lin) + [x]) as tracker:
        h = lin(x).relu()
        assert (
            tracker.live_bytes == 64 * 65 * 4 + 2 * act
        )  # params, x, h (addmm's output is freed by relu)
        h.sum().backward()
    assert tracker.live_bytes == 2 * 64 * 65 * 4 + 2 * act  # + grads
    assert tracker.peak_bytes > tracker.live_bytes  # backward temporaries
    with TensorMemoryTracker(state_tensors(lin)) as after:  # grads now exist at the start
        lin.zero_grad(set_to_none=True)
    assert after.peak_bytes == 2 * 64 * 65 * 4 and after.live_bytes == 64 * 65 * 4


def test_tensors_given_as_a_function_are_not_kept_alive_by_the_measurement() -> None:
    lin = nn.Linear(64, 64)
    lin(torch.randn(8, 64)).sum().backward()  # the previous step's gradients
    state = 64 * 65 * 4

    def step() -> None:
        lin.zero_grad(set_to_none=True)  # frees them, as the runtime's step does
        lin(torch.randn(8, 64)).sum().backward()

    # params + new grads + the step's input, output and temporaries, but not the old grads
    got = peak_tensor_bytes(torch.device("cpu"), step, lambda: state_tensors(lin))
    assert 2 * state <= got < 3 * state
    listed = peak_tensor_bytes(
        torch.device("cpu"), step, state_tensors(lin)
    )  # the list keeps the old ones
    assert listed >= 3 * state


def test_peak_tensor_bytes_on_cpu_runs_the_function_once() -> None:
    calls = []
    got = peak_tensor_bytes(torch.device("cpu"), lambda: calls.append(torch.zeros(1000)))
    assert calls and got == 4000


WIDE_MLP = """
import torch, torch.nn as nn, torch.nn.functional as F

def build_model():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 4))

def example_inputs(b):
    return (torch.randn(b, 8, generator=torch.Generator().manual_seed(1)),)

def example_targets(b):
    return torch.randint(0, 4, (b,), generator=torch.Generator().manual_seed(2))

def loss_fn(output, target):
    return F.cross_entropy(output, target)
"""


@pytest.fixture(scope="module")
def wide_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, dict]]:
    """An MLP whose activations (512 x 64 per tensor and microbatch) dwarf its weights,
    2 stages x 4 microbatches, one short run per schedule."""
    root = tmp_path_factory.mktemp("wide")
    (root / "wide.py").write_text(textwrap.dedent(WIDE_MLP))
    source = load_model_file(root / "wide.py")
    batch, micro = 2048, 4
    traced = trace_model_file(source, batch // micro)
    # the least bottleneck (stage 0 ends with a Linear): the step objective would end it with the ReLU,
    # whose output is both saved for backward and sent, which the formula counts twice (an over-estimate)
    plan = plan_partition(traced.profile, 2, microbatches=micro, objective="bottleneck")
    build = root / "build"
    write_build_dir(traced, plan, build, source, batch_size=batch, microbatches=micro)
    runs = {
        s: run_build(build, RunOptions(steps=2, schedule=s, timeout_s=60), quiet=True)
        for s in ("gpipe", "1f1b")
    }
    return json.loads((build / "plan.json").read_text()), runs


@pytest.mark.distributed
@pytest.mark.slow
def test_gpipe_holds_more_activations_than_1f1b_as_predicted(wide_runs) -> None:
    plan, runs = wide_runs
    predicted = plan["prediction"]["peak_memory_bytes_by_schedule"]
    for schedule, run in runs.items():
        assert len(run.peak_tensor_bytes) == 2 and len(run.peak_memory_bytes) == 2
    # stage 0 keeps 4 microbatches' activations under GPipe, 2 under 1F1B (Note [memory over time])
    act = plan["stages"][0]["memory"]["activations"] // 2  # 1F1B in flight on stage 0 of 2: 2
    gap = runs["gpipe"].peak_tensor_bytes[0] - runs["1f1b"].peak_tensor_bytes[0]
    predicted_gap = predicted["gpipe"][0] - predicted["1f1b"][0]
    assert 2 * act * 0.6 <= gap <= 2 * act * 1.1
    # measured 0.97 of the predicted gap (the receive pools counted on both sides)
    assert 0.85 * predicted_gap <= gap <= 1.05 * predicted_gap


@pytest.mark.distributed
@pytest.mark.slow
def test_measured_peak_within_5_percent_of_the_prediction(wide_runs) -> None:
    # gloo posts the step's 4 receives at its start; the tracker counts the pooled buffers. Measured
    # within 2-3% on every rank (0.98-1.02); a runtime that posted one action ahead holds 2 of the 4
    # on 1F1B's ranks, 13% of their predicted peak, and an uncounted pool would miss all 4
    plan, runs = wide_runs
    predicted = plan["prediction"]["peak_memory_bytes_by_schedule"]
    for schedule, run in runs.items():
        for rank, (meas, pred) in enumerate(zip(run.peak_tensor_bytes, predicted[schedule])):
            assert 0.95 <= meas / pred <= 1.05, (
                f"{schedule} rank {rank}: measured {meas} vs predicted {pred}"
            )
