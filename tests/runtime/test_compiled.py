"""Compiled stages (``PipelineRunner(compile=...)``) train like one eager process, for every schedule.

Compiling is slow on 2 cores, so each build's stages are compiled once (the first runner, with
``compile=True``: the warm-up, the compile report) and later runners get the same compiled
modules back through ``stage_loader``, their weights reset. The oracle is the original model in
one process, eager (fp32: losses and parameters within rtol 1e-4 after 3 steps; the compiled
kernels round differently). Single-rank builds run in this process (1f1b, gpipe, zb-h1 on one
stage; interleaved-1f1b on two stages of one rank); the V-shaped schedules need two ranks and
run in one spawned job (heavy tier).
"""

from __future__ import annotations

import copy
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from builds import EXAMPLES, make_build, original_model
from fxpipe.codegen import load_stage
from fxpipe.codegen.manifest import Manifest
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.pipeline.compiled import compiled_graphs, compile_module
from reference import reference_train
from spawn import spawn

STEPS, LR, BATCH, MICRO = 3, 0.1, 4, 2
CLOSE = {"rtol": 1e-4, "atol": 1e-5}
pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(k, v)


class _Loaded:
    """The stages of a build, loaded once and handed to every runner (weights reset each time)."""

    def __init__(self, build: Path) -> None:
        self.build = build
        self.manifest = Manifest.from_json(build)
        self.modules: dict[int, nn.Module] = {}
        self.initial: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, index: int, device: torch.device) -> nn.Module:
        if index not in self.modules:
            self.modules[index] = load_stage(self.build, index, device=device)
            self.initial[index] = copy.deepcopy(self.modules[index].state_dict())
        module = self.modules[index]
        module.load_state_dict(self.initial[index])
        for p in module.parameters():
            p.grad = None
        return module


def _run(
    loaded: _Loaded, source: Any, schedule: str, compile: bool, inputs: Any, targets: Any
) -> tuple[list[float], dict[str, torch.Tensor], PipelineRunner]:
    runner = PipelineRunner(
        loaded.manifest,
        source.loss_fn,
        stage_loader=loaded,
        schedule=schedule,
        microbatches=MICRO,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=120,
        compile=compile,
    )
    try:
        losses = [runner.step(inputs, targets) for _ in range(STEPS)]
        state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    finally:
        runner.close()
    return losses, state, runner


def _oracle(build: Path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    source = load_model_file(EXAMPLES / f"{name}.py")
    manifest = Manifest.from_json(build)
    model = original_model(build, source, manifest.num_stages)
    return reference_train(
        model,
        source.example_inputs(BATCH),
        source.example_targets(BATCH),
        source.loss_fn,
        STEPS,
        MICRO,
        LR,
    )


def _check(got: tuple[list[float], dict[str, torch.Tensor]], want: Any, what: str) -> None:
    losses, state = got
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(want[0]), **CLOSE, msg=f"{what}: losses"
    )
    for k, v in state.items():
        torch.testing.assert_close(v, want[1][k], **CLOSE, msg=f"{what}: {k}")


def test_gpt_compiled_every_one_rank_schedule_trains_like_one_process(
    one_rank: None, tmp_path: Path
) -> None:
    """gpt, one rank: zb-h1 (split backward) compiles (warm-up, report), then gpipe and 1f1b
    reuse the compiled stage; interleaved-1f1b on a two-stage build; no recompiles per step."""
    source = load_model_file(EXAMPLES / "gpt.py")
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    one = make_build("gpt", tmp_path / "one", 1, BATCH, MICRO)
    two = make_build("gpt", tmp_path / "two", 1, BATCH, MICRO, schedule="interleaved-1f1b")
    assert Manifest.from_json(two).num_stages == 2
    want_one, want_two = _oracle(one, "gpt"), _oracle(two, "gpt")
    loaded = _Loaded(one)
    *first, runner = _run(loaded, source, "zb-h1", True, inputs, targets)
    assert [c.stage for c in runner.compiled] == [0] and runner.compiled[0].seconds > 0
    _check(tuple(first), want_one, "zb-h1 compiled")  # type: ignore[arg-type]
    graphs = compiled_graphs()
    for schedule in ("gpipe", "1f1b"):
        *got, _ = _run(loaded, source, schedule, False, inputs, targets)
        _check(tuple(got), want_one, f"{schedule} compiled")  # type: ignore[arg-type]
    assert compiled_graphs() == graphs  # the steps ran the warm-up's graphs: no recompile
    *got, runner = _run(_Loaded(two), source, "interleaved-1f1b", True, inputs, targets)
    assert [c.stage for c in runner.compiled] == [0, 1]
    _check(tuple(got), want_two, "interleaved-1f1b compiled")  # type: ignore[arg-type]


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def test_a_graph_break_is_reported_with_its_place_not_fatal() -> None:
    torch.manual_seed(0)
    m = _Breaks()
    ref = copy.deepcopy(m)
    report = compile_module(m, "stage", [0])
    x = torch.randn(3, 4)
    torch.testing.assert_close(m(x), ref(x))
    assert len(report.graph_breaks) == 1 and "test_compiled.py" in report.graph_breaks[0]
    m(x)
    assert len(report.graph_breaks) == 1  # once per stage


def test_split_backward_of_a_compiled_stage_runs_its_backward_once() -> None:
    """B keeps the weight gradients the compiled region computed; W hands them over without
    running the region's backward again (Note [a boundary node that computes every gradient at
    once]); gradients equal the fused backward's."""
    from fxpipe.runtime.pipeline.split_backward import backward_inputs, backward_weights

    torch.manual_seed(0)
    fused = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    split = copy.deepcopy(fused)
    for m in (fused, split):
        compile_module(m, "stage", [0])
    x = torch.randn(3, 6)
    xf, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    fused(xf).backward(torch.ones(3, 6))
    out = split(xs)
    runs = []
    out.grad_fn.register_hook(lambda *_: runs.append(1))
    (gx,), work = backward_inputs([out], [torch.ones(3, 6)], [xs], list(split.parameters()))
    assert all(p.grad is None for p in split.parameters()) and len(runs) == 1
    backward_weights(work)
    assert len(runs) == 1  # W did not run the compiled backward again
    torch.testing.assert_close(gx, xf.grad, rtol=0, atol=0)
    for p, q in zip(split.parameters(), fused.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
