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
import torch.nn.functional as F

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
    loaded: _Loaded,
    source: Any,
    schedule: str,
    compile: bool | str,
    inputs: Any,
    targets: Any = None,
    own_loss: bool = False,
    lr: float = LR,
    counts: dict[str, int] | None = None,
    **options: Any,
) -> tuple[list[float], dict[str, torch.Tensor], PipelineRunner]:
    """Train ``STEPS`` steps; ``counts["graphs in steps"]``: the graphs Dynamo compiled during
    them (the warm-up before the first step should have compiled every one)."""
    runner = PipelineRunner(
        loaded.manifest,
        None if own_loss or not source.has_loss_fn else source.loss_fn,
        stage_loader=loaded,
        **options,
        schedule=schedule,
        microbatches=MICRO,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=lr),
        timeout_s=120,
        compile=compile,
    )
    try:  # the process group stays up when the caller made it (a spawned job)
        graphs = compiled_graphs()
        losses = [runner.step(inputs, targets) for _ in range(STEPS)]
        if counts is not None:
            counts["graphs in steps"] = compiled_graphs() - graphs
        state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    finally:
        runner.close()
    return losses, state, runner


def _counted_run(*args: Any, **options: Any) -> tuple[Any, dict[str, int]]:
    """``_run``, and what the compiled backward's halves counted during it
    (``compiled_split.stats``: halves run, weight halves deferred to ``W``, fallbacks), with the
    graphs compiled during the steps (``"graphs in steps"``)."""
    from fxpipe.runtime.pipeline.compiled_split import stats

    before = dict(stats)
    counts: dict[str, int] = {}
    got = _run(*args, counts=counts, **options)
    return got, {k: stats[k] - before[k] for k in stats} | counts


def _smp_tests_importable() -> None:
    """Make tests/smp's helpers (``seedscripts``, ``test_api_keywords``) importable."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "smp"))


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
    *got, _ = _run(loaded, source, "1f1b", False, inputs, targets, recompute=[True])
    _check(tuple(got), want_one, "1f1b compiled, recomputed")  # type: ignore[arg-type]
    *got, runner = _run(_Loaded(two), source, "interleaved-1f1b", True, inputs, targets)
    assert [c.stage for c in runner.compiled] == [0, 1]
    _check(tuple(got), want_two, "interleaved-1f1b compiled")  # type: ignore[arg-type]


def test_the_backward_in_halves_on_one_rank_and_under_bf16(one_rank: None, tmp_path: Path) -> None:
    """The default compiled backward (input and weight halves) under zbv with both chunks on one
    rank (stage 1 is fed activations, so its B and W split) trains like one process, and under
    bf16 autocast like eager bf16; each split microbatch defers its weight half to W, none falls
    back to the fused backward. (A split schedule refuses recomputed stages, compiled or not.)"""
    source = load_model_file(EXAMPLES / "gpt.py")
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    build = make_build("gpt", tmp_path / "v", 1, BATCH, MICRO, schedule="zbv")
    assert Manifest.from_json(build).stage_ranks == (0, 0)
    want = _oracle(build, "gpt")
    (*got, runner), halves = _counted_run(_Loaded(build), source, "zbv", True, inputs, targets)
    assert {c.backward for c in runner.compiled} == {"halves"}
    _check(tuple(got), want, "zbv compiled in halves, one rank")  # type: ignore[arg-type]
    assert halves["deferred"] == MICRO * STEPS and halves["fallbacks"] == 0, halves
    eager = _run(_Loaded(build), source, "zbv", False, inputs, targets, precision="bf16")
    comp, halves = _counted_run(
        _Loaded(build), source, "zbv", True, inputs, targets, precision="bf16"
    )
    assert halves["deferred"] == MICRO * STEPS and halves["fallbacks"] == 0, halves
    # the warm-up fed stage 1 bf16, as it receives under bf16 autocast: no graph in the steps
    assert halves["graphs in steps"] == 0, halves
    torch.testing.assert_close(torch.tensor(comp[0]), torch.tensor(eager[0]), rtol=2e-2, atol=2e-2)
    for k, v in comp[1].items():
        torch.testing.assert_close(v, eager[1][k], rtol=2e-2, atol=2e-2, msg=f"bf16 {k}")


class _OwnLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_regions_of_one_class_share_dynamos_graph_cache_and_its_limit_is_not_fatal() -> None:
    """Regions of one class (FSDP units: ``nn.Linear`` children of several shapes) share their
    ``forward``'s graph cache in the whole process: the limit is raised for all of the rank's
    regions, and a region that still meets it is reported and runs, not a crash."""
    import torch._dynamo.config

    from fxpipe.runtime.pipeline.compiled import allow_graphs_per_class

    limit = torch._dynamo.config.recompile_limit
    try:
        allow_graphs_per_class([nn.Linear(1, 1) for _ in range(20)] + [nn.LayerNorm(1)])
        assert torch._dynamo.config.recompile_limit >= 4 * 20 + 8
        allow_graphs_per_class([nn.Linear(1, 1)])  # never lowered by a smaller stage
        assert torch._dynamo.config.recompile_limit >= 4 * 20 + 8
        m = nn.Sequential(_OwnLinear(3, 5), _OwnLinear(5, 7))  # a code object of this test's own:
        ref = copy.deepcopy(m)  # past its limit Dynamo runs that code eagerly for good
        report = compile_module(m, "stage", regions=["0", "1"])
        torch._dynamo.config.recompile_limit = 1  # the second Linear's graph is one too many
        x = torch.randn(2, 3)
        torch.testing.assert_close(m(x), ref(x))
        assert report.graph_breaks and "1" in report.regions
    finally:
        torch._dynamo.config.recompile_limit = limit


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


def _tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * 2) + 1


def test_a_backend_failure_is_reported_with_the_operator_and_the_place_not_fatal() -> None:
    """A backend that cannot compile an operator: the fake-tensor kind Dynamo turns into a graph
    break is reported with the operator (Dynamo's explanation) and the user's line, the region
    compiled around it; any other failure is reported with the backend's error and the region
    runs eagerly, instead of ending the run (hubert_ctc's CTC loss meets the first kind)."""
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    from fxpipe.runtime.pipeline.compiled import _compiled

    def refusing(error: Exception) -> Any:
        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            if any(n.target in (torch.tanh, torch.ops.aten.tanh.default) for n in gm.graph.nodes):
                raise error
            return gm

        return backend

    x = torch.randn(3)
    for error, want in (
        (UnsupportedOperatorException(torch.ops.aten.tanh.default), "failed with aten.tanh"),
        (
            NotImplementedError("no tanh here"),
            "(NotImplementedError: no tanh here); it runs eagerly",
        ),
    ):
        torch._dynamo.reset()
        breaks: list[str] = []
        fn = _compiled(_tanh, breaks, None, backend=refusing(error))
        torch.testing.assert_close(fn(x), _tanh(x))
        torch.testing.assert_close(fn(x), _tanh(x))
        assert len(breaks) == 1 and want in breaks[0], breaks
        if isinstance(error, UnsupportedOperatorException):
            assert "test_compiled.py" in breaks[0], breaks  # the place: _tanh's line


def test_split_backward_of_a_compiled_stage_runs_its_backward_once() -> None:
    """B keeps the weight gradients the compiled region computed; W hands them over without
    running the region's backward again (Note [a boundary node that computes every gradient at
    once]); gradients equal the fused backward's."""
    from fxpipe.runtime.pipeline.split_backward import backward_inputs, backward_weights

    torch.manual_seed(0)
    fused = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    split = copy.deepcopy(fused)
    for m in (fused, split):  # one compiled backward graph (the split graphs: the next test)
        compile_module(m, "stage", [0], split_graphs=False)
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


def test_compiled_split_backward_computes_input_grads_in_b_and_weight_grads_in_w() -> None:
    """Split graphs (Note [deferring a compiled region's weight gradients]): B runs the region's
    input half only, W its weight half, once each; gradients equal eager's and those of the same
    compiled module's fused backward (which runs both halves at once)."""
    from fxpipe.runtime.pipeline import compiled_split
    from fxpipe.runtime.pipeline.split_backward import backward_inputs, backward_weights

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6), nn.LayerNorm(6))
    split = copy.deepcopy(eager)
    compile_module(split, "stage", [0], split_graphs=True)
    x, gy = torch.randn(3, 6), torch.randn(3, 6)
    xe, xs, xf = (x.clone().requires_grad_(True) for _ in range(3))
    eager(xe).backward(gy)
    split(xf).backward(gy)  # fused: the first call compiles both halves
    fused = [p.grad.clone() for p in split.parameters()]
    for p in split.parameters():
        p.grad = None
    stats = compiled_split.stats
    before = dict(stats)
    out = split(xs)
    (gx,), work = backward_inputs([out], [gy], [xs], list(split.parameters()))
    assert all(p.grad is None for p in split.parameters())
    assert stats["input_half"] == before["input_half"] + 1
    assert stats["weight_half"] == before["weight_half"]  # B ran no weight gradient
    assert stats["deferred"] == before["deferred"] + 1
    backward_weights(work)
    assert (
        stats["weight_half"] == before["weight_half"] + 1
        and stats["input_half"] == before["input_half"] + 1
    )
    assert stats["fallbacks"] == before["fallbacks"]
    torch.testing.assert_close(gx, xf.grad, rtol=0, atol=0)
    torch.testing.assert_close(gx, xe.grad, rtol=1e-5, atol=1e-6)
    for p, f, e in zip(split.parameters(), fused, eager.parameters()):
        torch.testing.assert_close(p.grad, f, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-5, atol=1e-6)


class _Depthwise(nn.Module):
    """Mamba's mixer in small: a projection, then a depthwise causal convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.conv = nn.Linear(8, 8), nn.Conv1d(8, 8, 3, groups=8, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).transpose(1, 2)
        return F.silu(self.conv(h)[..., : x.shape[1]]).transpose(1, 2)


def _split_against_eager(halves_ran: Any) -> None:
    """A ``_Depthwise`` compiled in halves, its backward split into ``B`` then ``W``, against the
    same module eager: gradients equal; ``halves_ran(split_module)`` runs between ``B`` and ``W``
    (assertions on what ``B`` did)."""
    from fxpipe.runtime.pipeline.split_backward import backward_inputs, backward_weights

    torch.manual_seed(0)
    eager = _Depthwise()
    split = copy.deepcopy(eager)
    compile_module(split, "stage", [0], split_graphs=True)
    x = torch.randn(2, 5, 8)
    xe, xs = (x.clone().requires_grad_(True) for _ in range(2))
    ye = eager(xe)
    gy = torch.randn_like(ye)
    ye.backward(gy)
    (gx,), work = backward_inputs([split(xs)], [gy], [xs], list(split.parameters()))
    halves_ran(split)
    backward_weights(work)
    torch.testing.assert_close(gx, xe.grad, rtol=1e-5, atol=1e-6)
    for p, e in zip(split.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-5, atol=1e-6)


def test_compiled_halves_of_a_convolution_whose_backward_gives_both_gradients_at_once() -> None:
    """A convolution's backward is one node giving the input's and the weight's gradients: the
    input half computes it and hands the weight half the weight's item (a graph returns tensors,
    not tuples; inductor refused the tuple). Deferred as usual, gradients equal eager's."""
    from fxpipe.runtime.pipeline import compiled_split

    before = dict(compiled_split.stats)

    def weights_deferred(split: nn.Module) -> None:
        assert all(p.grad is None for p in split.parameters())
        assert compiled_split.stats["deferred"] == before["deferred"] + 1

    _split_against_eager(weights_deferred)


def test_halves_that_do_not_compile_leave_the_one_graph_backward(monkeypatch: Any) -> None:
    """Where inductor cannot compile the halves (Note [halves that do not compile]), the region's
    backward is compiled as one graph, the reason kept for the run log, and gradients are right."""
    import torch._inductor.compile_fx as compile_fx

    from fxpipe.runtime.pipeline import compiled_split
    from fxpipe.runtime.pipeline.compiled import CompiledStage

    halves: list[torch.fx.GraphModule] = []
    split_graph, compile_inner = compiled_split.split_graph, compile_fx.compile_fx_inner

    def recorded(*args: Any) -> Any:
        cut = split_graph(*args)
        halves.extend(cut[:2] if cut else ())
        return cut

    def refusing(gm: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        if any(gm is h for h in halves):
            raise RuntimeError("this half is refused")
        return compile_inner(gm, *args, **kwargs)

    monkeypatch.setattr(compiled_split, "split_graph", recorded)
    monkeypatch.setattr(compile_fx, "compile_fx_inner", refusing)
    torch._dynamo.reset()
    failed = len(compiled_split.split_failures)

    def one_graph(split: nn.Module) -> None:
        assert halves and compiled_split.split_failures[failed:] == [
            "RuntimeError: this half is refused"
        ]

    _split_against_eager(one_graph)
    report = CompiledStage(0, "stage", ("",), backward="halves", one_graph=["RuntimeError: x"])
    assert "but one graph where they failed to compile: RuntimeError: x" in report.line()


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return self.b(torch.tanh(self.a(x.reshape(b * t, 8)))).reshape(b, t, 8)


def test_the_warm_up_compiles_the_training_graphs_whatever_the_callers_mode() -> None:
    """A warm-up run in eval mode under no_grad (the seed API's first call may be one) still
    compiles what training runs, forward and backward, and leaves the mode as it found it."""
    from fxpipe.runtime.pipeline.compiled import _warm_up

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    compile_module(m, "stage", [0])
    m.eval()
    with torch.no_grad():
        _warm_up(m, [torch.randn(3, 4)], False)
    assert not m.training and not m[1].training
    graphs = compiled_graphs()
    m.train()
    m(torch.randn(3, 4)).sum().backward()
    assert compiled_graphs() == graphs
    # the eval warm-up (Note [compiled eval graphs]) compiles what eval_step runs, in train mode
    # as the caller left it, its running statistics untouched
    stats = m[1].running_mean.clone()
    _warm_up(m, [torch.randn(3, 4)], False, training=False)
    assert m.training and torch.equal(m[1].running_mean, stats) and compiled_graphs() > graphs
    graphs = compiled_graphs()
    m.eval()
    with torch.no_grad():
        x = torch.randn(3, 4)
        torch.testing.assert_close(m(x), m[1](m[0](x)))  # eval: the running statistics
    assert compiled_graphs() == graphs


def test_a_module_compiled_again_compiles_its_own_code() -> None:
    """``compile_module`` on a module compiled before (a second runner over the same stage
    modules) compiles the module's own forward in the new scope, not the first compile's
    wrappers (Dynamo refused to trace their ``maybe_mark_dynamic``)."""
    torch.manual_seed(0)
    m = nn.Sequential(_Flat(), _Flat())  # two blocks of one class: "regional" compiles each
    ref = copy.deepcopy(m)
    x = torch.randn(2, 3, 8)
    for scope in ("stage", "stage", "regional", "stage"):
        report = compile_module(m, scope, [0])
        torch.testing.assert_close(m(x), ref(x))
        assert report.regions == (("0", "1") if scope == "regional" else ("",))
        assert not report.graph_breaks, (scope, report.graph_breaks)


def _split_like_eager(m: nn.Module, ref: nn.Module, batch: int, length: int) -> None:
    """``m``'s backward split in ``B`` (input gradients) and ``W`` (weights) on a
    ``(batch, length, 8)`` input gives the gradients of ``ref``'s plain backward."""
    from fxpipe.runtime.pipeline.split_backward import backward_inputs, backward_weights

    x, gy = torch.randn(batch, length, 8), torch.randn(batch, length, 8)
    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (gx,), work = backward_inputs([m(xs)], [gy], [xs], list(m.parameters()))
    backward_weights(work)
    ref(xr).backward(gy)
    torch.testing.assert_close(gx, xr.grad, rtol=1e-5, atol=1e-6)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        p.grad = q.grad = None


def test_compiled_split_backward_with_a_dynamic_batch_binds_its_sizes_in_both_halves() -> None:
    """A batch dim marked dynamic: the weight half's inputs have sizes such as ``4*s0`` that only
    the backward's symbolic inputs bind (each half takes them all); two batch sizes, one graph,
    gradients equal eager's."""
    torch.manual_seed(0)
    m = _Flat()
    ref = copy.deepcopy(m)
    compile_module(m, "stage", [0], split_graphs=True)
    graphs = compiled_graphs()
    for batch in (2, 3):
        _split_like_eager(m, ref, batch, 4)
    assert compiled_graphs() == graphs + 1


class _Scaled(nn.Module):
    """A per-channel scale on a transposed activation: with a dynamic length ``s0`` the weight
    half takes ``(3, 16, s0)`` gradients whose strides name it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)).transpose(1, 2) * self.scale[:, None]
        return self.b(torch.relu(h).transpose(1, 2))


def test_a_boundary_tensor_with_symbolic_strides_reaches_the_weight_half_in_its_dense_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Note [the boundary's strides] with a dynamic size: the halves of ``_Scaled`` compiled with
    a dynamic length record the dim order of the boundary tensors whose strides name it. The
    input half is made to lay those tensors out otherwise (the innermost two dims swapped, as
    inductor did to the zoo's ConvNeXt), which the weight half's own stride check refuses; they
    reach it copied into the dense strides of the recorded order at the run's sizes, and the
    gradients equal eager's at two lengths. A tensor that agrees passes as it is."""
    from fxpipe.runtime.pipeline import compiled_split
    from fxpipe.runtime.pipeline.compiled_split import SplitCode, _Plan, dense_strides, stats

    plans: list[_Plan] = []
    init = SplitCode.__init__

    def relaid(self: SplitCode, *args: Any) -> None:
        init(self, *args)
        plans.append(self.plan)
        half, n_i = self.input_half, len(self.plan.input_outputs)

        def input_half(a: list[Any]) -> list[Any]:
            got = list(half(a))
            for j, order in self.plan.boundary_orders:
                other = (*order[:-2], order[-1], order[-2])
                y = got[n_i + j].permute(other).contiguous()
                got[n_i + j] = y.permute(sorted(range(y.dim()), key=other.index))
            return got

        self.input_half = input_half

    monkeypatch.setattr(compiled_split.SplitCode, "__init__", relaid)
    torch.manual_seed(0)
    m = _Scaled()
    ref = copy.deepcopy(m)
    compile_module(m, "stage", [0], dynamic_dims=[[1]], split_graphs=True)
    before = stats["restrided"]
    for t in (5, 7):
        _split_like_eager(m, ref, 3, t)
    assert len(plans) == 1 and plans[0].boundary_orders, plans
    assert stats["restrided"] == before + 2 * len(plans[0].boundary_orders)
    assert dense_strides((2, 3, 4), (0, 2, 1)) == (12, 1, 3)

    monkeypatch.undo()  # the halves as they are, given by hand
    seen: list[torch.Tensor] = []
    plan = _Plan(1, [0], [], [0], [], 2, [], [(0, (0, 1)), (1, (1, 0))])
    x = torch.randn(5, 3)
    code = SplitCode(
        lambda a: [a[0], x.t().contiguous().t(), x.t()], lambda a: seen.extend(a) or [], plan, []
    )
    before = stats["restrided"]
    code([torch.zeros(1)])
    assert stats["restrided"] == before + 1
    assert seen[0].stride() == (3, 1) and torch.equal(seen[0], x)  # copied: row-major order
    assert seen[1].stride() == (1, 3) and seen[1].data_ptr() == x.data_ptr()  # as it is


def _v_job(rank: int, world: int, build: Path, one: Path, h1: Path) -> dict[str, Any]:
    dist.init_process_group("gloo")
    source = load_model_file(EXAMPLES / "gpt.py")
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    loaded = _Loaded(build)
    out = {}
    runs = [(loaded, "zbv", True), (loaded, "dualpipev", False), (_Loaded(h1), "zb-h1", True)]
    for where, schedule, compile in runs:  # compiled once per build, by its first runner
        # the backward in halves, the default (the DDP run below: one graph)
        (losses, state, runner), halves = _counted_run(
            where, source, schedule, compile, inputs, targets
        )
        out[schedule] = (losses, state, [c.stage for c in runner.compiled])
        out[schedule + " backward"] = {c.backward for c in runner.compiled}
        out[schedule + " halves"] = halves
        out[schedule + " split"] = sorted(runner.schedule.split_backward())
    # one stage, two data-parallel replicas (DDP) fed the same batch: the one-process step
    losses, state, runner = _run(
        _Loaded(one), source, "zb-h1", True, inputs, targets, compile_backward="graph"
    )
    assert runner.data_parallel is not None
    out["ddp"] = (losses, state, [c.stage for c in runner.compiled])
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
def test_gpt_compiled_v_schedules_and_ddp_on_two_ranks_train_like_one_process(
    tmp_path: Path,
) -> None:
    """ZBV, DualPipeV (two stages per rank) and ZB-H1 (one) on two ranks, compiled, their split
    backward compiled as input and weight halves (``compile_backward="halves"``: B runs no weight half, each
    stage fed activations defers one per split microbatch to W); and a one-stage build as two DDP
    replicas under zb-h1, compiled with one backward graph."""
    build = make_build("gpt", tmp_path / "v", 2, BATCH, MICRO, schedule="zbv")
    one = make_build("gpt", tmp_path / "one", 1, BATCH, MICRO)
    h1 = make_build("gpt", tmp_path / "h1", 2, BATCH, MICRO)
    want, want_one, want_h1 = _oracle(build, "gpt"), _oracle(one, "gpt"), _oracle(h1, "gpt")
    results = [r.value for r in spawn(_v_job, 2, build, one, h1, timeout=2400)]
    assert sorted(results[0]["zbv"][2] + results[1]["zbv"][2]) == [0, 1, 2, 3]
    for schedule, oracle in (("zbv", want), ("dualpipev", want), ("zb-h1", want_h1)):
        state: dict[str, torch.Tensor] = {}
        for r in results:
            state.update(r[schedule][1])
        _check((results[0][schedule][0], state), oracle, f"{schedule} compiled")
        # each split (stage, microbatch) of a stage fed activations (not stage 0: token ids)
        # defers its weight half to W once per step; none falls back to the fused backward
        fed = [s for s, _ in results[0][schedule + " split"] if s != 0]
        halves = [r[schedule + " halves"] for r in results]
        assert fed and sum(h["deferred"] for h in halves) == len(fed) * STEPS, (schedule, halves)
        assert sum(h["fallbacks"] for h in halves) == 0, (schedule, halves)
        assert all(r[schedule + " backward"] <= {"halves"} for r in results), schedule
    for r in results:
        _check(r["ddp"][:2], want_one, "zb-h1 compiled, 2 DDP replicas")


def _ddp_job(rank: int, world: int, build: Path) -> dict[str, Any]:
    from fxpipe.runtime.dataparallel import DataParallelOptions

    dist.init_process_group("gloo")
    source = load_model_file(EXAMPLES / "gpt.py")
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    out = {}
    for form in ("halves", "graph"):
        (losses, state, runner), halves = _counted_run(
            _Loaded(build),
            source,
            "zbv",
            True,
            inputs,
            targets,
            data_parallel=DataParallelOptions(),
            compile_backward=form,
        )
        assert runner.data_parallel is not None
        out[form] = (losses, state, halves)
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
def test_both_forms_of_the_compiled_backward_under_ddp_train_like_one_process(
    tmp_path: Path,
) -> None:
    """zbv with both chunks on one pipeline rank, two DDP replicas, compiled: with the backward in
    halves (each weight half deferred to W, where DDP's gradient hooks fire) and as one graph
    (nothing deferred), the step equals one eager process."""
    build = make_build("gpt", tmp_path / "v", 1, BATCH, MICRO, schedule="zbv")
    want = _oracle(build, "gpt")
    for result in (r.value for r in spawn(_ddp_job, 2, build, timeout=1800)):
        for form, deferred in (("halves", MICRO * STEPS), ("graph", 0)):
            losses, state, halves = result[form]
            assert halves["deferred"] == deferred and halves["fallbacks"] == 0, (form, halves)
            _check((losses, state), want, f"zbv compiled ({form}), 2 DDP replicas")


def _partition(target: str, out: Path, *options: str, batch: int = BATCH) -> Path:
    from fxpipe.cli import main

    args = ["partition", target, "--stages", "1", "--batch-size", str(batch)]
    args += ["--microbatches", str(MICRO), "--out", str(out), *options]
    assert main(args) == 0
    return out


def test_llama_with_labels_and_an_inplace_model_compiled_train_like_one_process(
    one_rank: None, tmp_path: Path
) -> None:
    """A transformers Llama trained on its own loss (``labels=``) under zb-h1, and a model that
    changes tensors in place (``h += block(h)``) under 1f1b with bf16 autocast against eager bf16."""
    import inplace_models

    llama = Path(__file__).resolve().parents[1] / "zoo" / "models" / "llama.py"
    build = _partition(
        f"{llama}:build_model", tmp_path / "llama", "--inputs-fn", "example_kwargs_labels"
    )
    source = load_model_file(llama, inputs_fn="example_kwargs_labels")
    model = source.build_model().train()
    model.load_state_dict(load_stage(build, 0).state_dict(), strict=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    call = source.example_call(BATCH).kwargs
    chunks = [{k: v.chunk(MICRO)[m] for k, v in call.items()} for m in range(MICRO)]
    want_losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        step = [model(**c).loss for c in chunks]
        (sum(step) / MICRO).backward()
        opt.step()
        want_losses.append(sum(float(v.detach()) for v in step) / MICRO)
    want_state = {k: v.detach() for k, v in model.state_dict().items()}
    losses, state, runner = _run(
        _Loaded(build), source, "zb-h1", True, source.example_call(BATCH), own_loss=True
    )
    assert runner.compiled and not runner.compiled[0].graph_breaks
    _check((losses, state), (want_losses, want_state), "llama labels= zb-h1 compiled")

    factory = "build_residual_stream"
    target = f"{inplace_models.__file__}:{factory}"
    build = _partition(target, tmp_path / "inplace")
    source = load_model_file(inplace_models.__file__, model_fn=factory)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    want = reference_train(
        original_model(build, source, 1), inputs, targets, source.loss_fn, STEPS, MICRO, LR
    )
    got = _run(_Loaded(build), source, "1f1b", True, inputs, targets)
    _check(got[:2], want, "in-place 1f1b compiled")
    eager = _run(_Loaded(build), source, "zb-h1", False, inputs, targets, precision="bf16")
    comp = _run(_Loaded(build), source, "zb-h1", True, inputs, targets, precision="bf16")
    torch.testing.assert_close(torch.tensor(comp[0]), torch.tensor(eager[0]), rtol=2e-2, atol=2e-2)
    for k, v in comp[1].items():
        torch.testing.assert_close(v, eager[1][k], rtol=2e-2, atol=2e-2, msg=f"bf16 {k}")


def test_zoo_cnns_with_in_place_ops_and_batch_norm_compiled_train_like_one_process(
    one_rank: None, tmp_path: Path
) -> None:
    """The zoo's torchvision-style ResNet-18 (``nn.ReLU(inplace=True)``, ``out += identity``,
    BatchNorm) and RegNet (grouped convolutions, squeeze-excitation, in-place ReLU after
    ``proj(x) + f(x)``, BatchNorm), two chunks on
    one rank, compiled: under zbv (the backward in halves) and then under interleaved-1f1b on the
    same compiled stages, equal to one eager process, BatchNorm's running statistics included.
    Batch 16 (8 a microbatch) and SGD at 0.01: at 2 a microbatch BatchNorm over these 8x8 images
    is so badly conditioned that fp32 eager itself leaves fp64 eager by 1.6% in two steps, and at
    0.1 three steps amplify a compiled kernel's rounding past rtol 1e-4 (plain ``torch.compile``
    of the model alike); fp64, compiled and eager agree to 1e-8 either way. (The zoo's CNNs with
    dropout draw other masks compiled: inductor has its own random-number kernels.)"""
    zoo = Path(__file__).resolve().parents[1] / "zoo" / "models"
    batch, lr = 16, 0.01
    for path, factory in ((zoo / "resnet.py", "build_resnet18"), (zoo / "regnet.py", None)):
        target = f"{path}:{factory}" if factory else str(path)
        build = _partition(target, tmp_path / path.stem, "--schedule", "zbv", batch=batch)
        assert Manifest.from_json(build).stage_ranks == (0, 0)
        source = load_model_file(path, model_fn=factory)
        inputs, targets = source.example_inputs(batch), source.example_targets(batch)
        model = original_model(build, source, 2)
        want = reference_train(model, inputs, targets, source.loss_fn, STEPS, MICRO, lr)
        loaded = _Loaded(build)
        got = _run(loaded, source, "zbv", True, inputs, targets, lr=lr)
        assert {c.backward for c in got[2].compiled} == {"halves"}
        _check(got[:2], want, f"{path.stem} zbv compiled")
        got = _run(loaded, source, "interleaved-1f1b", False, inputs, targets, lr=lr)
        _check(got[:2], want, f"{path.stem} interleaved-1f1b compiled")


def _runner(
    build: Path | _Loaded, source: Any, schedule: str, lr: float = LR, **options: Any
) -> PipelineRunner:
    """A runner of ``build`` (its stages loaded by a ``_Loaded``) under SGD at ``lr``."""
    loaded = build if isinstance(build, _Loaded) else _Loaded(build)
    return PipelineRunner(
        loaded.manifest,
        source.loss_fn,
        stage_loader=loaded,
        schedule=schedule,
        microbatches=MICRO,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=lr),
        timeout_s=120,
        **options,
    )


def _eval_loss(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any) -> float:
    """The original model's eval-mode loss under no_grad, the mean over microbatches (as
    ``eval_step`` gives it)."""
    model.eval()
    with torch.no_grad():
        chunks = zip(zip(*(x.chunk(MICRO) for x in inputs)), targets.chunk(MICRO))
        return sum(loss_fn(model(*mb), t).item() for mb, t in chunks) / MICRO


def test_a_run_that_evaluates_compiles_the_eval_graphs_before_the_first_step(
    one_rank: None, tmp_path: Path
) -> None:
    """``compile_eval=True`` (``fxpipe run --eval-every``): the warm-up compiles the eval-mode,
    no_grad forward too (Note [compiled eval graphs]), so evaluations and the steps between them
    compile nothing; the eval losses equal the original model's in eval mode (BatchNorm on its
    running statistics, which the eval warm-up leaves as they were) before and after a step, and
    the steps equal one eager process. The example ResNet, two chunks on one rank under zbv (the
    backward in halves)."""
    source = load_model_file(EXAMPLES / "resnet.py")
    batch, lr = 16, 0.01  # BatchNorm at 8 a microbatch (test_zoo_cnns_...: conditioning)
    inputs, targets = source.example_inputs(batch), source.example_targets(batch)
    build = make_build("resnet", tmp_path / "r", 1, batch, MICRO, schedule="zbv")
    model = original_model(build, source, 2)
    want_losses, want_state = reference_train(model, inputs, targets, source.loss_fn, 2, MICRO, lr)
    after_one = copy.deepcopy(model)
    after_one.load_state_dict(
        reference_train(model, inputs, targets, source.loss_fn, 1, MICRO, lr)[1]
    )
    runner = _runner(build, source, "zbv", lr, compile=True, compile_eval=True)
    try:
        assert all(c.eval_seconds and 0 < c.eval_seconds < c.seconds for c in runner.compiled)
        assert "s of it the eval graphs" in runner.compiled[0].line()
        # checked through the runner, inductor's kernels, in both modes
        assert all(c.line().endswith("(train and eval)") for c in runner.compiled)
        graphs = compiled_graphs()
        got = [runner.eval_step(inputs, targets), runner.step(inputs, targets)]
        got += [runner.eval_step(inputs, targets), runner.step(inputs, targets)]
        assert compiled_graphs() == graphs
        state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    finally:
        runner.close()
    evals = [_eval_loss(m, inputs, targets, source.loss_fn) for m in (model, after_one)]
    torch.testing.assert_close(torch.tensor(got[0::2]), torch.tensor(evals), **CLOSE)
    torch.testing.assert_close(torch.tensor(got[1::2]), torch.tensor(want_losses), **CLOSE)
    for k, v in state.items():
        torch.testing.assert_close(v, want_state[k], **CLOSE, msg=k)


def test_the_warm_ups_feed_a_stage_as_the_runtime_does_under_bf16_and_in_place_inputs(
    one_rank: None, tmp_path: Path
) -> None:
    """Dynamo compiles again for an input of another dtype or grad requirement, so both warm-ups
    feed a stage as ``StageWorker`` does (Note [compiled eval graphs]): received tensors in bf16
    under bf16 autocast, and an input the stage changes in place copied under the warm-up's grad
    mode (the training warm-up changed the leaf itself and failed; the eval one fed a tensor that
    requires grad, so the first evaluation compiled again). The in-place model cut where its
    second stage changes what it receives (``--split-at act``), two chunks on one rank, zbv:
    evaluations and steps compile nothing and equal the eager runner's."""
    import inplace_models

    factory = "build_functional"
    target = f"{inplace_models.__file__}:{factory}"
    build = _partition(target, tmp_path / "f", "--split-at", "act", "--schedule", "zbv")
    assert Manifest.from_json(build).stage(1).mutated_inputs
    source = load_model_file(inplace_models.__file__, model_fn=factory)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    got = {}
    for compile in (False, True):
        runner = _runner(
            build, source, "zbv", precision="bf16", compile=compile, compile_eval=compile
        )
        try:
            graphs = compiled_graphs()
            got[compile] = [f(inputs, targets) for f in (runner.eval_step, runner.step) * 2]
            assert compiled_graphs() == graphs
        finally:
            runner.close()
    torch.testing.assert_close(
        torch.tensor(got[True]), torch.tensor(got[False]), rtol=2e-2, atol=2e-2
    )


def _miscompiled(module: nn.Module, when: Any = lambda module, args: True) -> nn.Module:
    """``module`` whose compiled forward gives 1% more than its code ``when(module, args)``: the
    compiler traces the ``is_compiling()`` branch, the eager run does not (a stand-in for a
    compiler defect)."""
    forward = module.forward

    def off(*args: Any) -> Any:
        out = forward(*args)
        if not (torch.compiler.is_compiling() and when(module, args)):
            return out
        return tuple(o * 1.01 for o in out) if isinstance(out, tuple) else out * 1.01

    module.forward = off  # type: ignore[method-assign]
    return module


class _Off(nn.Module):
    """A linear layer (and dropout) whose compiled code computes 1% more than its eager code
    (``is_compiling()``: a stand-in for a compiler defect), unless ``right``."""

    def __init__(self, p: float = 0.0, right: bool = False) -> None:
        super().__init__()
        self.a, self.d, self.right = nn.Linear(8, 8), nn.Dropout(p), right

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.d(self.a(x))
        return y * 1.01 if torch.compiler.is_compiling() and not self.right else y


def test_the_check_against_eager_finds_a_stage_computing_something_else() -> None:
    """Note [checking a compiled stage at the warm-up], its comparison: the compiled stage that
    computes 1% more fails on every tensor (output, input and parameter gradients), the right
    one passes, one with dropout is reported random (unchecked); the state is left as it was.
    (Dynamo's ``eager`` backend: the check is the backend's business, and inductor is slow here.)"""
    from fxpipe.runtime.pipeline.compiled import _warm_up
    from fxpipe.runtime.pipeline.compiled_check import check_against_eager

    torch.manual_seed(0)
    got = {}
    for name, m in (("off", _Off()), ("right", _Off(right=True)), ("dropout", _Off(0.5))):
        m.forward = torch.compile(m.forward, backend="eager")  # type: ignore[method-assign]
        x = torch.randn(4, 8, requires_grad=True)
        _warm_up(m, [x], False)
        state, rng = copy.deepcopy(m.state_dict()), torch.get_rng_state()
        got[name] = check_against_eager(m, [x])
        assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())
        assert torch.equal(torch.get_rng_state(), rng) and m.a.weight.grad is None
    assert not got["off"].ok and got["off"].failing == got["off"].compared == 4
    assert got["right"].ok and not got["right"].random and got["right"].compared == 4
    assert got["dropout"].random and got["dropout"].ok


def test_the_check_holds_a_stage_computing_in_bf16_to_bf16s_tolerance() -> None:
    """A stage that computes in bf16 without autocast (FSDP's ``param_dtype``, casts of its own:
    its outputs and gradients come in bf16) is held to the bf16 tolerance, where compiled kernels
    round otherwise by a few ulps (here 0.4%, two bf16 ulps): no false alarm; the same 0.4% in
    fp32 fails (1e-3)."""
    from fxpipe.runtime.pipeline.compiled import _warm_up
    from fxpipe.runtime.pipeline.compiled_check import check_against_eager

    got = {}
    for dtype in (torch.bfloat16, torch.float32):
        m = _Off(right=True).to(dtype)
        forward = m.forward

        def rounded_otherwise(x: torch.Tensor, forward: Any = forward) -> torch.Tensor:
            return forward(x) * (1.004 if torch.compiler.is_compiling() else 1.0)

        m.forward = torch.compile(rounded_otherwise, backend="eager")  # type: ignore[method-assign]
        x = torch.randn(4, 8, dtype=dtype, requires_grad=True)
        _warm_up(m, [x], False)
        got[dtype] = check_against_eager(m, [x])
    assert got[torch.bfloat16].ok, got[torch.bfloat16]
    assert not got[torch.float32].ok, got[torch.float32]


def test_the_check_counts_tf32_products_on_cuda_as_reduced_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA, fp32 matmuls in TF32 (``set_float32_matmul_precision("high")``) or convolutions
    (cuDNN's TF32, on by default) round at 10 bits, in other kernels eager and compiled: the
    check's tolerance is fp16's there, fp32's otherwise (and on the CPU, always)."""
    from fxpipe.runtime.pipeline.compiled_check import _tf32

    class OnCuda:  # what the check reads of a tensor (this machine has no GPU)
        is_cuda = True

    linear, conv = nn.Linear(2, 2), nn.Sequential(nn.Conv2d(1, 1, 1))
    cuda, cpu = [("output[0]", OnCuda())], [("output[0]", torch.zeros(1))]
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert _tf32(linear, cuda) is None and _tf32(conv, cuda) == torch.float16
    assert _tf32(conv, cpu) is None
    was, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
    try:  # (not an attribute monkeypatch can restore)
        assert _tf32(linear, cuda) == torch.float16 and _tf32(linear, cpu) is None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def test_the_check_in_eval_mode_compares_the_forward_a_stage_with_dropout_included() -> None:
    """The check of the eval graphs (``training=False``): the forward in eval mode under
    ``no_grad``, outputs only; the stage that computes 1% more fails, and the one with dropout,
    which the training check cannot compare, is compared (dropout draws nothing in eval mode)."""
    from fxpipe.runtime.pipeline.compiled import _warm_up
    from fxpipe.runtime.pipeline.compiled_check import check_against_eager

    got = {}
    for name, m in (("off", _Off()), ("dropout", _Off(0.5, right=True))):
        m.forward = torch.compile(m.forward, backend="eager")  # type: ignore[method-assign]
        x = torch.randn(4, 8, requires_grad=True)
        _warm_up(m, [x], False, training=False)
        before = compiled_graphs()
        got[name] = check_against_eager(m, [x], training=False)
        assert compiled_graphs() == before  # the eval graph the warm-up compiled, no other
        assert m.training and m.a.weight.grad is None
    assert not got["off"].ok and got["off"].compared == 1  # the output: no gradient in eval
    assert got["dropout"].ok and not got["dropout"].random and got["dropout"].compared == 1


def test_the_warm_up_checks_a_dynamic_build_at_its_second_sizes_and_its_eval_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dynamic build's stage compiled right at its traced length and wrong at others (its
    compiled code branches on the length: Dynamo specializes and compiles the second length
    apart, a stand-in for a defect at one size) stops the warm-up at the second size, the size
    named; a stage wrong in eval mode only stops it when the eval graphs are compiled."""
    import functools

    from fxpipe.runtime.pipeline.compiled import compile_rank_stages
    from fxpipe.runtime.pipeline.compiled_check import CompiledMismatchError

    model = Path(__file__).with_name("varlen_lm.py")
    build = make_build(model, tmp_path / "build", 1, 4, 2)
    manifest = Manifest.from_json(build)
    traced = manifest.dynamic[0].traced
    # the eager backend: what is checked is the compiled code, not inductor's kernels (slow here)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))

    def stage(off: Any) -> dict[int, nn.Module]:
        return {0: _miscompiled(load_stage(build, 0), off)}

    def compile(stages: dict[int, nn.Module], eval_graphs: bool = False) -> Any:
        torch._dynamo.reset()
        return compile_rank_stages(
            manifest, stages, torch.device("cpu"), 2, split_backward=False, eval_graphs=eval_graphs
        )

    at_other_lengths = stage(lambda m, xs: xs[0].shape[1] != traced)
    with pytest.raises(CompiledMismatchError, match=rf"warm-up's inputs, seq = {traced + 1}\."):
        compile(at_other_lengths)
    in_eval = stage(lambda m, xs: not m.training)
    (report,) = compile(in_eval)
    assert report.check is not None and report.check.ok and report.eval_check is None
    assert not report.graph_breaks  # the stand-in compiled as one graph: the check saw it
    wrong_in_eval = rf"code in eval mode: .* inputs, seq = {traced}\. .* without --compile \(or eva"
    with pytest.raises(CompiledMismatchError, match=wrong_in_eval):
        compile(stage(lambda m, xs: not m.training), eval_graphs=True)
    (report,) = compile(stage(lambda m, xs: False), eval_graphs=True)
    assert report.line().endswith("; equals its eager code (train and eval)")


def test_the_log_line_says_what_the_check_compared() -> None:
    """A stage with dropout: its training graphs are not checked, its eval graphs are when the
    warm-up compiles them; a stage without: checked in train mode, and in eval mode too."""
    from fxpipe.runtime.pipeline.compiled import CompiledStage
    from fxpipe.runtime.pipeline.compiled_check import EagerCheck

    random, equal = EagerCheck(random=True), EagerCheck(random=False, compared=3)
    line = CompiledStage(0, "stage", ("",), check=random).line(timed=False)
    assert line.endswith(
        "; its training graphs are not checked against its eager code: they draw "
        "random numbers (fxpipe verify --compile checks them)"
    ), line
    line = CompiledStage(0, "stage", ("",), check=random, eval_check=equal).line(timed=False)
    assert "; its eval graphs equal its eager code; its training graphs are not checked" in line
    line = CompiledStage(0, "stage", ("",), check=equal, eval_check=equal).line(timed=False)
    assert line.endswith("; equals its eager code (train and eval)"), line
    line = CompiledStage(0, "stage", ("",), check=equal, eval_check=random).line(timed=False)
    assert line.endswith("in training; its eval graphs draw random numbers: not checked"), line
    assert CompiledStage(0, "stage", ("",)).line(timed=False).endswith("; one graph per region")


def test_a_mismatch_in_a_stage_with_batchnorm_names_the_likely_cause() -> None:
    """docs/compile.md: the zoo ResNet at microbatch 2 (BatchNorm over 2 values per channel) is
    refused rightly, and its user is told why and what may pass; a stage without BatchNorm, or a
    mismatch in eval mode (running statistics), is not."""
    from fxpipe.codegen.check.equivalence import TensorError
    from fxpipe.runtime.pipeline.compiled import _mismatch_text, _normalizes
    from fxpipe.runtime.pipeline.compiled_check import EagerCheck

    off = EagerCheck(False, TensorError("grad bn.bias", 0.04, 0.1, False, 0.009), 1, 3)
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    assert _normalizes(cnn) and not _normalizes(nn.Linear(2, 2))
    hint = "It normalizes with BatchNorm in training"
    text = _mismatch_text(1, off, batchnorm=_normalizes(cnn))
    assert text.startswith("stage 1 compiled computes something else") and hint in text
    assert "a larger microbatch may pass" in text
    assert hint not in _mismatch_text(1, off) and hint not in _mismatch_text(
        1, off, training=False, batchnorm=True
    )


class _Miscompiled(_Loaded):
    """Stages whose compiled forward computes 1% more than their code: the compiler traces the
    ``is_compiling()`` branch, the eager run does not (a stand-in for a compiler defect)."""

    def __call__(self, index: int, device: torch.device) -> nn.Module:
        return _miscompiled(super().__call__(index, device))


def test_a_compiled_stage_that_computes_something_else_stops_the_run_before_the_first_step(
    one_rank: None, tmp_path: Path
) -> None:
    """Note [checking a compiled stage at the warm-up]: a stage whose compiled forward and backward
    differ from its eager code on the warm-up's inputs stops the runner with the stage and the
    tensor named; ``compile_check=False`` (``--compile-unchecked``) lets it run; a stage that
    compiles right reports that it equals its eager code."""
    from fxpipe.runtime.pipeline.compiled_check import CompiledMismatchError

    source = load_model_file(EXAMPLES / "mlp.py")
    build = make_build("mlp", tmp_path / "m", 1, BATCH, MICRO)
    with pytest.raises(CompiledMismatchError, match=r"stage 0 compiled computes something else"):
        _runner(_Miscompiled(build), source, "1f1b", compile=True)
    runner = _runner(_Miscompiled(build), source, "1f1b", compile=True, compile_check=False)
    runner.close()
    assert runner.compiled[0].check is None
    runner = _runner(build, source, "1f1b", compile=True)
    runner.close()
    check = runner.compiled[0].check
    assert check is not None and check.ok and not check.random and check.compared > 2
    assert runner.compiled[0].line().endswith("; equals its eager code")


def _seed_job(rank: int, world: int) -> dict[str, Any]:
    _smp_tests_importable()
    from seedscripts import load_script

    config = {
        "partitions": 2,
        "microbatches": 2,
        "pipeline": "zb-h1",
        "compile": True,
        "compile_backward": "halves",  # each compiled backward in an input and a weight half
    }
    return load_script("hf_keywords").main(config)


@pytest.mark.distributed
def test_seed_api_compiled_zero_bubble_trains_like_one_process() -> None:
    """``fxpipe.init({..., "compile": True})``: a Hugging Face loop (keyword call, ``labels=``,
    ``model.backward(out.loss)``) on 2 ranks under zb-h1, stages compiled."""
    _smp_tests_importable()
    from test_api_keywords import _one_process

    results = [r.value for r in spawn(_seed_job, 2, timeout=1800)]
    losses, state = _one_process()
    for got in results:
        torch.testing.assert_close(got["losses"], losses, **CLOSE)
        for key, value in got["state_dict"].items():
            torch.testing.assert_close(value, state[key], **CLOSE, msg=key)


def _seed_sharded_job(rank: int, world: int) -> dict[str, Any]:
    _smp_tests_importable()
    from seedscripts import load_script

    from torch._dynamo.utils import counters

    from fxpipe.smp.state import current

    import fxpipe.smp.partitioning as partitioning

    warmed: list[int] = []  # graphs once the warm-up (after the FSDP wrap) is done
    warm_up = partitioning.warm_up_rank_stages

    def counted(*args: Any, **kwargs: Any) -> None:
        warm_up(*args, **kwargs)
        warmed.append(compiled_graphs())

    partitioning.warm_up_rank_stages = counted  # type: ignore[assignment]
    config = {"partitions": 1, "microbatches": 2, "ddp": True, "shard": "full", "compile": True}
    out = load_script("hf_keywords").main(config)
    out["graphs in steps"] = compiled_graphs() - warmed[0] if len(warmed) == 1 else warmed
    out["state_dict"] = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in out["state_dict"].items()
    }
    model = current().model
    out["fsdp"] = any(type(m).__name__.startswith("FSDP") for m in model.modules())
    out["breaks"] = sum(counters["graph_break"].values())  # none: compiled inside the units
    return out


def _seed_miscompiled_job(rank: int, world: int, unchecked: bool) -> str:
    """The seed API on one rank, its stage loaded as ``_Miscompiled`` loads one: the first step's
    outcome (``"trained"`` or the error's text)."""
    import fxpipe.smp as api
    import fxpipe.smp.partitioning as partitioning
    from fxpipe.runtime.pipeline.compiled_check import CompiledMismatchError

    load = partitioning.load_checked_stage

    def miscompiled(*args: Any, **kwargs: Any) -> nn.Module:
        return _miscompiled(load(*args, **kwargs))

    partitioning.load_checked_stage = miscompiled  # type: ignore[assignment]
    api.init({"partitions": 1, "microbatches": 2, "compile": True, "compile_unchecked": unchecked})
    model = api.DistributedModel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @api.step
    def train(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    try:
        train(torch.randn(4, 8))
    except CompiledMismatchError as exc:
        return str(exc)
    optimizer.step()
    return "trained"


@pytest.mark.distributed
def test_seed_api_stops_a_miscompiled_stage_unless_compile_unchecked() -> None:
    """The seed config's ``compile_unchecked`` (as ``--compile-unchecked``): by default a stage
    whose compiled code computes something else stops the first step, naming the stage; with the
    key the step runs (Note [checking a compiled stage at the warm-up])."""
    checked = spawn(_seed_miscompiled_job, 1, False, timeout=600)[0].value
    assert "stage 0 compiled computes something else" in checked, checked
    assert "set config 'compile_unchecked': True" in checked and "--compile" not in checked
    assert spawn(_seed_miscompiled_job, 1, True, timeout=600)[0].value == "trained"


def _seed_eval_job(rank: int, world: int, compile_eval: bool) -> dict[str, Any]:
    """One training step and two evaluations (``model.eval()``, ``no_grad``) of a model with
    dropout through the seed API, compiled: graphs compiled after the first step, eval losses,
    and the eager model's."""
    import fxpipe.smp as api
    from fxpipe.smp.state import current

    api.init({"partitions": 1, "microbatches": 2, "compile": True, "compile_eval": compile_eval})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1))
    model = api.DistributedModel(net)

    @api.step
    def train(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    @api.step
    def evaluate(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).mean()

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    train(x)
    graphs = compiled_graphs()
    model.eval()
    with torch.no_grad():
        losses = [evaluate(x).reduce_mean().item() for _ in range(2)]
    stage = current().model.module
    stage.eval()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        out = stage(x)
    eager = (out[0] if isinstance(out, tuple) else out).pow(2).mean().item()
    return {"graphs in evaluations": compiled_graphs() - graphs, "losses": losses, "eager": eager}


@pytest.mark.distributed
def test_seed_api_compile_eval_compiles_the_eval_graphs_at_the_first_step() -> None:
    """``compile_eval: True``: the evaluations after the first step compile nothing (without it,
    the first compiles the eval graphs), and their loss equals the stage's eager eval loss."""
    ready = spawn(_seed_eval_job, 1, True, timeout=600)[0].value
    assert ready["graphs in evaluations"] == 0, ready
    torch.testing.assert_close(ready["losses"], [ready["eager"]] * 2, rtol=1e-5, atol=1e-6)
    lazy = spawn(_seed_eval_job, 1, False, timeout=600)[0].value
    assert lazy["graphs in evaluations"] > 0, lazy


@pytest.mark.distributed
def test_seed_api_compiled_and_fully_sharded_trains_like_one_process() -> None:
    """``{"compile": True, "shard": "full"}``: two fully sharded replicas of one partition, each
    stage compiled inside its FSDP units and warmed up after the wrap (the steps compile nothing
    more), train like one process."""
    _smp_tests_importable()
    from test_api_keywords import _one_process

    results = [r.value for r in spawn(_seed_sharded_job, 2, timeout=1800)]
    losses, state = _one_process()
    for got in results:
        assert got["fsdp"] and got["breaks"] == 0, got["breaks"]
        assert got["graphs in steps"] == 0, got["graphs in steps"]  # Note [compiling under FSDP]
        torch.testing.assert_close(got["losses"], losses, **CLOSE)
        for key, value in got["state_dict"].items():
            torch.testing.assert_close(value, state[key], **CLOSE, msg=key)


@pytest.mark.distributed
def test_fxpipe_run_compile_reports_compile_seconds_and_fills_the_builds_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fxpipe run --compile`` (run_build): trains like one process, run.json has each stage's
    compile seconds, inductor's cache is in the build directory, and ``--compile-backward graph``
    (not the default) reaches the runner: the log's compile lines name no halves."""
    from fxpipe.runtime.launch.launcher import run_build
    from fxpipe.runtime.train.run_options import RunOptions

    build = make_build("gpt", tmp_path / "b", 2, BATCH, MICRO)
    want = _oracle(build, "gpt")
    options = RunOptions(
        steps=STEPS,
        microbatches=MICRO,
        lr=LR,
        timeout_s=1800,
        schedule="zb-h1",
        compile=True,
        compile_backward="graph",
    )
    result = run_build(build, options)
    log = [ln for ln in capsys.readouterr().out.splitlines() if " compiled (" in ln]
    assert len(log) == 2 and not any("halves" in ln for ln in log), log
    assert len(result.compile_seconds) == 2 and min(result.compile_seconds) > 0
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want[0]), **CLOSE)
    assert any((build / "compile_cache").rglob("*"))


def test_the_runner_refuses_a_compile_option_before_any_communication(
    tmp_path: Path, one_rank: None
) -> None:
    """``PipelineRunner(compile_backward=...)`` is refused whether or not it compiles (before: a
    misspelt form passed unnoticed without ``compile``), and, like ``compile=``, before the
    process group starts."""
    from fxpipe.errors import ConfigError

    build = make_build("mlp", tmp_path / "b", 1, 4, 2)
    for kwargs, line in (
        ({"compile_backward": "half"}, "compile_backward must be one of"),
        ({"compile": True, "compile_backward": "half"}, "compile_backward must be one of"),
        ({"compile": "everything"}, "compile must be True, False or a scope"),
    ):
        with pytest.raises(ConfigError, match=line):
            PipelineRunner(build, None, microbatches=2, **kwargs)  # type: ignore[arg-type]
        assert not dist.is_initialized()


def test_compile_backward_names_a_form_of_the_backward() -> None:
    """``--compile-backward`` and ``PipelineRunner(compile_backward=...)`` take ``graph`` or
    ``halves``; anything else is refused in one line naming both."""
    from fxpipe.errors import ConfigError
    from fxpipe.runtime.pipeline.runner import _split_graphs
    from fxpipe.runtime.train.run_options import RunOptions

    assert RunOptions().compile_backward == "halves"
    assert _split_graphs("halves") and not _split_graphs("graph")
    with pytest.raises(
        ConfigError, match=r"--compile-backward must be one of \['graph', 'halves'\]"
    ):
        RunOptions(compile_backward="split")
    with pytest.raises(ConfigError, match=r"compile_backward must be one of"):
        _split_graphs("half")
