"""Compiled stages: each stage's forward, or each repeated block in it, under ``torch.compile``.

``compile_rank_stages`` compiles the stages of one rank in place (the instance's ``forward`` is
replaced, so parameters, ``state_dict`` keys, hooks, DDP and the optimizer see the same module)
and pays the compile before the first step: a warm-up forward and backward per stage on
synthetic inputs of the manifest's shapes, after which gradients, buffers (batch norm's running
statistics) and the RNG state are put back as they were, so a compiled run trains exactly the
steps an eager run does.

Note [compile scope]: ``"stage"`` compiles the stage's whole forward (one graph where the stage
allows it); ``"regional"`` compiles each outermost submodule whose class occurs at least twice in
the stage (a transformer's blocks: torchtitan's per-block compile), leaving the glue between
them eager, and falls back to the whole stage when nothing repeats. Same-class blocks share one
compiled graph (Dynamo treats their parameters as inputs), so regional compile time grows with
the number of distinct block classes, not blocks. Which one is the default was measured
(docs/compile.md, benchmarks/runtime/compiled.md). Under FSDP (``--shard``) either scope compiles
inside the FSDP units instead, as torchtitan does (``regions``: the units with no unit inside,
``fxpipe.runtime.dataparallel.fsdp_units.compile_regions``): FSDP gathers a unit's parameters in
hooks around the unit's own forward, which Dynamo does not trace (a whole stage compiled around
them broke its graph at every unit), so each unit's forward is compiled and the hooks and the
glue between the units stay eager.

Note [compiling under FSDP]: ``fully_shard`` changes each unit's class in place (``Linear``
becomes ``FSDPLinear``), and Dynamo guards a compiled forward on its module's type: graphs
compiled before the wrap are not reused after it (every region compiled a second time, inside
the first step). A sharded rank therefore compiles before the wrap (``compile_rank_stages(...,
warm_up=False)``, so the regions are the units' children) and warms up after it
(``warm_up_rank_stages`` inside ``ShardedStage.warming_up``): the warm-up's forward and backward
go through FSDP's all-gathers and reduce-scatters, as every replica of the stage runs the same
warm-up, and are then undone like any warm-up, FSDP's per-step switches and counts reset.

Note [graph breaks are reported, not fatal]: each compiled forward first runs with
``fullgraph=True``; if Dynamo cannot capture it in one graph, the break's reason and place (the
user frame) are recorded once, and that forward is compiled again without ``fullgraph`` (Dynamo
splits it into graphs around the break). A backend that cannot compile an operator is one more
break where Dynamo makes it one (the reason then names the operator: inductor cannot compile
``aten._ctc_loss_backward.Tensor``, so the zoo's wav2vec2 and HuBERT keep their CTC loss eager,
the rest of the stage compiled); any other failure of the backend on the
one graph is reported with its error and that forward runs eagerly, rather than ending the run
(with one graph, nothing ran before the failure: at its first call its backward is compiled
with its forward, ``force_non_lazy_backward_lowering``, where AOTAutograd would compile it at the
first backward). A failure when the one graph compiles again later (eval mode, a new size) is
raised, not hidden. ``CompiledStage.graph_breaks`` lists what was found; the run log prints it.

Note [compiled split backward]: a compiled region's backward is AOTAutograd's one backward graph,
one autograd node (``CompiledFunctionBackward``) computing every gradient at once. Under a
schedule that splits the backward (ZB-H1, ZBV, DualPipeV) it runs in one of two forms.

``--compile-backward graph``: the split backward keeps, in ``B``, the weight gradients that node
produced and hands them to the parameters in ``W`` (Note [a boundary node that computes every
gradient at once] in ``fxpipe.runtime.pipeline.split_backward``): ``B`` does the whole backward,
``W`` accumulates.

``--compile-backward halves``, the default (``PipelineRunner(compile_backward="halves")``,
``compile_module(..., split_graphs=True)``), cuts each region's
backward graph into an input half (the gradients of the region's non-parameter inputs, plus the
intermediate values the other half needs) and a weight half (the parameters' gradients from those
values and the saved activations), each compiled by inductor
(``fxpipe.runtime.pipeline.compiled_split``). ``B`` then runs the input half only and ``W`` the
weight half (Note [deferring a compiled region's weight gradients]); a backward that is not split
(1F1B, the warm-up) runs both at once. Gradients equal the one-graph backward's. Measured
(docs/compile.md): on gpt_medium's loss stage ``B`` costs 0.63x the one-graph ``B`` and the
stage's ``F + B + W`` 1.02x; in the 2-rank pipelines of the compiled benchmark (gpt_medium and a
transformers Llama, ZB-H1 and ZBV, quiet host) the step was 0.93-0.98x the one-graph step, ``B``
0.64-0.71x: ``B`` is on the schedule's critical path and ``W`` fills its bubbles, so the halves
are the default.

Note [compiled dynamic dimensions]: with the ``"stage"`` scope every dimension of a stage input
that follows the step is marked dynamic (``maybe_mark_dynamic``): the batch, and in a build with
dynamic dimensions (Note [shape formulas] in ``fxpipe.shapeformula``) each dimension whose formula
reads a symbol (``seq``, ``mb*seq``) or depends on the data (``"?"``). So a microbatch of another
size or another length does not recompile where the stage's code allows it (a static build's code
holds its sizes: Dynamo then specializes, and a new size compiles once). Regional blocks see
internal tensors whose formulas the manifest does not hold; they rely on Dynamo's automatic
dynamic shapes (a second size compiles once, dynamic). The warm-up of a build with dynamic
dimensions therefore runs twice, at the traced sizes and at other sizes in the ranges
(``_second_sizes``), so that second compile happens before the first step in either scope, and
training at any length in the ranges compiles nothing more (``compiled_graphs`` counts). A stage's
inputs are made contiguous before they reach the compiled forward: Dynamo guards on strides, and a
data function's view (``rows[:, :-1]``, next-token inputs cut from one row) would otherwise compile
the stage again for its strides, whose formula is not the warm-up's.

Note [compiled eval graphs]: Dynamo guards a compiled forward on the module's mode and on grad
mode, so ``eval_step`` (eval mode, ``no_grad``) runs graphs of its own, which would compile at the
first evaluation, in the middle of the run (the GPT example's two stages: 13 s with a cold cache,
unreported), where a backend failure would end a run that had trained for hours. A run that
evaluates (``fxpipe run --eval-every``, ``PipelineRunner(compile_eval=True)``) compiles them in
the warm-up too, after the training graphs and at the same sizes; the run log gives their share
of the stage's seconds. Either warm-up feeds a stage as ``StageWorker`` does, or Dynamo would
compile again at the first step or evaluation: received tensors in the dtype they travel in
(bf16 under bf16 autocast, ``wire_dtype``), and an input the stage changes in place copied
first, under the warm-up's grad mode (a copy made under ``no_grad`` requires no gradient).

The inductor cache (``TORCHINDUCTOR_CACHE_DIR``) is pointed at ``cache_dir`` (a folder the user
named, else the build's ``compile_cache`` unless the environment names one of the user's), so a second run of the same build loads its kernels and graphs
instead of compiling them.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fxpipe.codegen.manifest import INPUT, Manifest
from fxpipe.shapeformula import BATCH, UNKNOWN, evaluate, symbols_of
from fxpipe.errors import ConfigError
from fxpipe.runtime.pipeline.compiled_check import (
    CompiledMismatchError,
    EagerCheck,
    check_against_eager,
    run_stage,
    state_undone,
)
from fxpipe.runtime.pipeline.compiled_split import first_line, split_backend, split_failures
from fxpipe.runtime.pipeline.precision import wire_dtype
from fxpipe.runtime.pipeline.routes import needs_grad
from fxpipe.runtime.train.run_options import COMPILE_SCOPES, DEFAULT_COMPILE_SCOPE

__all__ = [
    "COMPILE_SCOPES",
    "DEFAULT_COMPILE_SCOPE",
    "CompiledStage",
    "compile_module",
    "compile_rank_stages",
    "warm_up_rank_stages",
    "use_cache_dir",
    "compiled_graphs",
]


@dataclass
class CompiledStage:
    """What compiling one stage did: the compiled regions (module paths; ``""``: the whole
    stage), the graph breaks found (reason and place, once each) and the warm-up's seconds."""

    stage: int
    scope: str
    regions: tuple[str, ...]
    seconds: float = 0.0
    graph_breaks: list[str] = field(default_factory=list)
    backward: str = "graph"  # or "halves": Note [compiled split backward]
    # halves that did not compile: those regions' backward is one graph (Note [halves that do
    # not compile] in compiled_split)
    one_graph: list[str] = field(default_factory=list)
    unit: str = "blocks"  # what the regions are: repeated "blocks", or "FSDP units"
    eval_seconds: float | None = None  # of ``seconds``, the eval graphs' (None: not compiled)
    check: EagerCheck | None = None  # against its eager code (None: not checked)
    eval_check: EagerCheck | None = None  # its eval graphs' (None: not compiled or not checked)

    def line(self, timed: bool = True) -> str:
        """One log line (``timed``: with the warm-up's seconds)."""
        where = "whole stage" if self.regions == ("",) else f"{len(self.regions)} {self.unit}"
        if self.backward == "halves":
            where += ", backward in input and weight halves"
        if self.one_graph:
            where += " but one graph where they failed to compile: " + " | ".join(self.one_graph)
        breaks = (
            f"; {len(self.graph_breaks)} graph break(s): " + " | ".join(self.graph_breaks)
            if self.graph_breaks
            else "; one graph per region"
        )
        took = f" in {self.seconds:.1f} s" if timed else ""
        if timed and self.eval_seconds is not None:
            took += f" ({self.eval_seconds:.1f} s of it the eval graphs)"
        checked = ""  # Note [checking a compiled stage at the warm-up]
        evaluated = self.eval_check is not None and not self.eval_check.random
        if self.check is not None and not self.check.random:
            checked = "; equals its eager code" + (" (train and eval)" if evaluated else "")
            if self.eval_check is not None and self.eval_check.random:
                checked += " in training; its eval graphs draw random numbers: not checked"
        elif self.check is not None:
            checked = (
                "; its training graphs are not checked against its eager code: they draw random "
                "numbers (fxpipe verify --compile checks them)"
            )
            if evaluated:
                checked = "; its eval graphs equal its eager code" + checked
        return f"stage {self.stage} compiled ({self.scope}: {where}){took}{breaks}{checked}"


def _mismatch_text(
    stage: int,
    check: EagerCheck,
    sizes: Mapping[str, int] | None = None,
    training: bool = True,
    batchnorm: bool = False,
) -> str:
    """The error of ``stage`` whose compiled forward and backward (not ``training``: eval forward)
    differ from its eager code (``check``) on the warm-up's inputs (at a dynamic build's
    ``sizes``; none: the traced ones). ``batchnorm``: the stage normalizes batches in training,
    which the error names as a likely cause (docs/compile.md: the zoo ResNet at microbatch 2)."""
    assert check.worst is not None
    worst = check.worst
    at = "".join(f", {name} = {n}" for name, n in (sizes or {}).items())
    mode, instead = (
        ("", "") if training else (" in eval mode", " (or evaluate without --eval-every)")
    )
    cause = (
        " It normalizes with BatchNorm in training: over few values per channel, as a small "
        "microbatch gives, compiled kernels can be far from eager's; a larger microbatch may pass."
        if batchnorm and training
        else ""
    )
    return (
        f"stage {stage} compiled computes something else than its code{mode}: {worst.name} is "
        f"{worst.max_abs:.3g} off its eager value (allowed {worst.allowed:.3g}; {check.failing} "
        f"of {check.compared} tensors off) on the warm-up's inputs{at}. The compiler (inductor) "
        f"miscomputes this model here: train it without --compile{instead}, or pass "
        f"--compile-unchecked to train on these numbers anyway (docs/compile.md).{cause}"
    )


def _normalizes(module: nn.Module) -> bool:
    """Whether ``module`` holds a BatchNorm (in training it normalizes with its batch's
    statistics)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def use_cache_dir(path: str | Path | None, explicit: bool = False) -> str:
    """Point inductor's cache at ``path``: always when ``explicit`` (the user named it), else
    unless ``TORCHINDUCTOR_CACHE_DIR`` names a folder of the user's (importing inductor sets it to
    its default, which does not count); the folder in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    users = bool(current) and os.path.abspath(current or "") != os.path.abspath(default_cache_dir())
    if path is None or (users and not explicit):
        return current or ""
    Path(path).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(path).resolve())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _break_text(exc: BaseException) -> str:
    """``reason (file:line in fn)`` of a ``fullgraph=True`` failure. A failure of the backend
    (inductor cannot compile an operator) has no user stack: its reason takes Dynamo's explanation
    (which names the operator) and its place the user frame its message quotes."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    reason = lines[0] if lines else type(exc).__name__
    why = next((ln for ln in lines if ln.startswith("Explanation:")), "")
    stack = getattr(exc, "real_stack", None) or []
    if why and not stack:
        reason += ": " + why.removeprefix("Explanation:").strip()
    if stack:
        f = stack[-1]
        return f"{reason} (at {Path(f.filename).name}:{f.lineno} in {f.name})"
    quoted = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
    if quoted:  # the innermost frame, as for ``real_stack``
        file, line, fn = quoted[-1]
        return f"{reason} (at {Path(file).name}:{line} in {fn})"
    return reason


def _failure_text(exc: torch._dynamo.exc.BackendCompilerFailed) -> str:
    """What a backend's failure to compile a region reports: the backend's error, and that the
    region runs eagerly."""
    inner = exc.inner_exception
    first = first_line(inner)
    error = f"{type(inner).__name__}: {first}" if first else type(inner).__name__
    return f"the backend failed to compile it ({error}); it runs eagerly"


def _compiled(
    fn: Callable[..., Any],
    breaks: list[str],
    dynamic: Sequence[Sequence[int]] | None,
    **options: Any,
) -> Callable[..., Any]:
    """``fn`` under torch.compile: ``fullgraph=True`` first, without it after a graph break
    (Note [graph breaks are reported, not fatal]); ``dynamic[i]``: the dims of argument ``i``
    marked dynamic (Note [compiled dynamic dimensions])."""
    full = torch.compile(fn, fullgraph=True, **options)
    current: Callable[..., Any] = full
    ran = False  # the one graph ran once: compiled, and its backward with it

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal current, ran
        if _get_current_dispatch_mode() is not None:  # Dynamo skips frames under a dispatch
            return fn(*args, **kwargs)  # mode (the peak-memory tracker): run eagerly
        if (
            dynamic is not None
        ):  # a stage's inputs: contiguous, marked (Note [compiled dynamic dimensions])
            args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
            for a, dims in zip(args, dynamic):
                for d in dims:
                    if isinstance(a, torch.Tensor) and a.dim() > d:
                        torch._dynamo.maybe_mark_dynamic(a, d)
        if current is full:
            first = not ran
            try:  # one graph; at the first call its backward is compiled with it, so any
                # failure comes before anything ran (AOTAutograd would compile it at the first
                # backward, after the forward ran)
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=first):
                    out = full(*args, **kwargs)
                ran = True
                return out
            except (
                torch._dynamo.exc.Unsupported,
                torch._dynamo.exc.FailOnRecompileLimitHit,  # the frame then runs eagerly
            ) as exc:
                breaks.append(_break_text(exc))
                current = torch.compile(fn, fullgraph=False, **options)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                if not first:  # a recompile (eval mode, a new size): the graphs that compiled
                    raise  # stay; the failure is not hidden behind a silent eager fallback
                breaks.append(_failure_text(exc))  # it would fail again: eager
                current = fn
        return current(*args, **kwargs)

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    run.fxpipe_compiled = True  # type: ignore[attr-defined]
    return run


def _uncompiled(module: nn.Module) -> None:
    """Give ``module`` and its submodules back the forwards they had before ``compile_module``:
    a stage compiled again (a second runner over the same stage modules) compiles its own code,
    not the wrappers (Dynamo refuses to trace their ``maybe_mark_dynamic``)."""
    for m in module.modules():  # one level: compile_module unwraps before it wraps
        if getattr(m.forward, "fxpipe_compiled", False):
            m.forward = m.forward.__wrapped__  # type: ignore[attr-defined]


def _repeated_blocks(module: nn.Module) -> list[str]:
    """Paths of the outermost submodules whose class occurs at least twice in ``module``
    (classes of ``torch.nn`` itself are layers, not blocks)."""
    mods = dict(module.named_modules())
    counts = Counter(
        type(m) for p, m in mods.items() if p and not type(m).__module__.startswith("torch.")
    )
    chosen: list[str] = []
    for path, m in mods.items():
        if not path or counts.get(type(m), 0) < 2:
            continue
        if any(path.startswith(c + ".") for c in chosen):
            continue
        chosen.append(path)
    return chosen


def compile_module(
    module: nn.Module,
    scope: str,
    batch_dims: Sequence[int | None] | None = None,
    stage: int = 0,
    split_backward: bool = True,
    dynamic_dims: Sequence[Sequence[int]] | None = None,
    split_graphs: bool = False,
    regions: Sequence[str] | None = None,
) -> CompiledStage:
    """Compile ``module`` in place (Note [compile scope]); nothing is compiled until it runs.
    ``regions``: compile these submodules' forwards rather than what ``scope`` picks (the FSDP
    units a sharded stage will have).

    With the ``"stage"`` scope, each input's batch dim (``batch_dims``) and its dims in
    ``dynamic_dims`` (one sequence per input) are marked dynamic (Note [compiled dynamic dimensions]).

    ``split_backward``: the stage's backward may run split (``B`` keeps the graph for ``W``), so
    AOTAutograd must not donate the saved tensors' buffers to the backward (it refuses
    ``retain_graph`` then): ``torch._functorch.config.donated_buffer`` is turned off in this
    process. With it, ``split_graphs`` compiles each region's backward as an input half and a
    weight half (``--compile-backward halves``: Note [compiled split backward])."""
    if scope not in COMPILE_SCOPES:
        raise ConfigError(f"compile scope must be one of {list(COMPILE_SCOPES)}, got {scope!r}")
    if split_backward:
        torch._functorch.config.donated_buffer = False
    options: dict[str, Any] = {}
    if split_backward and split_graphs:
        options["backend"] = split_backend
    report = CompiledStage(
        stage, scope, ("",), backward="halves" if "backend" in options else "graph"
    )
    _uncompiled(module)
    if regions is None:
        regions = _repeated_blocks(module) if scope == "regional" else []
    else:
        allow_graphs_per_class([module.get_submodule(p) for p in regions])
    if regions:
        report.regions = tuple(regions)
        for path in regions:
            block = module.get_submodule(path)
            block.forward = _compiled(block.forward, report.graph_breaks, None, **options)
    else:
        module.forward = _compiled(
            module.forward, report.graph_breaks, _marked(batch_dims, dynamic_dims), **options
        )
    return report


def allow_graphs_per_class(regions: Sequence[nn.Module]) -> None:
    """Dynamo keeps a code object's graphs in one cache for the whole process, at most
    ``recompile_limit`` of them: the regions of one class (FSDP units: the ``nn.Linear`` children
    of a split block, of several shapes) share their ``forward``'s code and may each need a graph,
    in train and eval mode. ``regions``: every region the process compiles (all its stages')."""
    import torch._dynamo.config

    per_class = Counter(type(m) for m in regions)
    need = 4 * max(per_class.values(), default=0) + 8  # train, eval; static, then dynamic
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, need)


def _marked(
    batch_dims: Sequence[int | None] | None, dynamic_dims: Sequence[Sequence[int]] | None
) -> list[list[int]] | None:
    """Per input: its batch dim and its other dynamic dims, together; None when neither is given."""
    if batch_dims is None and dynamic_dims is None:
        return None
    count = len(batch_dims if batch_dims is not None else dynamic_dims or ())
    batch = batch_dims if batch_dims is not None else [None] * count
    extra = dynamic_dims if dynamic_dims is not None else [()] * count
    return [sorted({*extra[i], *(() if batch[i] is None else (batch[i],))}) for i in range(count)]


def _followed_dims(manifest: Manifest, stage: int) -> list[list[int]]:
    """Per input of ``stage``: the dimensions whose formula reads a dynamic symbol or depends on the
    data (Note [compiled dynamic dimensions])."""
    return [
        [d for d, f in enumerate(t.dims or ()) if f == UNKNOWN or symbols_of(f)]
        for t in manifest.stage(stage).inputs
    ]


def _second_sizes(manifest: Manifest) -> dict[str, int]:
    """Sizes other than the traced ones inside every dynamic dimension's range, for the second warm-up
    (one more than traced, or one less at the top of the range; Dynamo specializes 0 and 1)."""
    sizes = {}
    for r in manifest.dynamic:
        up = r.traced + 1
        other = up if r.holds(up) else r.traced - 1
        if other >= 2 and r.holds(other):
            sizes[r.name] = other
    return sizes


def _warm_inputs(
    manifest: Manifest,
    stage: int,
    mb_size: int,
    device: torch.device,
    sizes: Mapping[str, int] | None = None,
    autocast: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Synthetic inputs of stage ``stage`` at microbatch size ``mb_size`` and the dynamic ``sizes``
    (default: the traced ones), as ``StageWorker`` feeds it: received tensors in the dtype they
    travel in under ``autocast`` (``wire_dtype``), those that need a gradient leaves that require
    one (``_warm_up`` copies those the stage changes in place). A dimension that depends on the
    data takes its traced size."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    at = {r.name: r.traced for r in manifest.dynamic} | dict(sizes or {})
    args = []
    for t in manifest.stage(stage).inputs:
        if t.data_dependent:
            bound = {BATCH: mb_size, **at}
            shape = tuple(
                n if f == UNKNOWN else evaluate(f, bound) for f, n in zip(t.dims or (), t.shape)
            )
        else:
            shape = t.shape_at(mb_size, manifest.microbatch_size, at)
        dtype = getattr(torch, t.dtype)
        if t.producer != INPUT:
            dtype = wire_dtype(dtype, autocast)
        if dtype.is_floating_point:
            x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        else:
            x = torch.zeros(shape, dtype=dtype, device=device)
        if t.producer != INPUT and needs_grad(t) and dtype.is_floating_point:
            x.requires_grad_(True)
        args.append(x)
    return args


def _warm_up(
    module: nn.Module,
    args: list[torch.Tensor],
    recompute: bool,
    training: bool = True,
    mutated: Sequence[int] = (),
) -> None:
    """One forward and backward of ``module`` in train mode (the graphs training runs, whatever
    mode the caller left it in), or (not ``training``) one forward in eval mode under
    ``no_grad`` (the graphs ``eval_step`` runs), whose effects are undone: gradients, buffers,
    the mode, and torch's, numpy's and Python's random state (the job's first step draws what it
    would draw without the warm-up). The inputs at ``mutated``, which the stage changes in place,
    are copied first under that grad mode, as ``StageWorker`` feeds them."""
    with state_undone(module, training), torch.set_grad_enabled(training):
        run_stage(module, args, recompute, mutated, torch.ones_like)


def compile_rank_stages(
    manifest: Manifest,
    stages: Mapping[int, nn.Module],
    device: torch.device,
    mb_size: int,
    *,
    scope: str = DEFAULT_COMPILE_SCOPE,
    recompute: Sequence[int] = (),
    cache_dir: str | Path | None = None,
    warm_up: bool = True,
    split_backward: bool = True,
    cache_explicit: bool = False,
    split_graphs: bool = False,
    regions: Mapping[int, Sequence[str]] | None = None,
    eval_graphs: bool = False,
    autocast: torch.dtype | None = None,
    check: bool = True,
) -> list[CompiledStage]:
    """Compile this rank's ``stages`` in place and (``warm_up``) compile them now, forward and
    backward, at microbatch size ``mb_size``, and with ``eval_graphs`` the eval forward too
    (Note [compiled eval graphs]); one ``CompiledStage`` per stage. ``regions``: per
    stage, the FSDP units to compile inside (Note [compile scope]); a sharded rank passes
    ``warm_up=False`` and calls ``warm_up_rank_stages`` after the wrap (Note [compiling under
    FSDP])."""
    use_cache_dir(cache_dir, explicit=cache_explicit)
    if regions:  # the rank's regions of a class share one graph cache, across its stages
        allow_graphs_per_class(
            [stages[s].get_submodule(p) for s, paths in regions.items() for p in paths]
        )
    reports = []
    for s, module in sorted(stages.items()):
        units = (regions or {}).get(s)
        dims = [t.batch_dim for t in manifest.stage(s).inputs]
        report = compile_module(
            module,
            scope,
            dims,
            stage=s,
            split_backward=split_backward,
            dynamic_dims=_followed_dims(manifest, s),
            split_graphs=split_graphs,
            regions=units or None,  # none: the scope decides
        )
        if units:
            report.unit = "FSDP units"
        reports.append(report)
    if warm_up:
        warm_up_rank_stages(
            manifest, stages, device, mb_size, reports, recompute, eval_graphs, autocast, check
        )
    return reports


def warm_up_rank_stages(
    manifest: Manifest,
    stages: Mapping[int, nn.Module],
    device: torch.device,
    mb_size: int,
    reports: Sequence[CompiledStage],
    recompute: Sequence[int] = (),
    eval_graphs: bool = False,
    autocast: torch.dtype | None = None,
    check: bool = True,
    fsdp_dtypes: Sequence[str | None] = (),
) -> None:
    """Compile this rank's compiled ``stages`` now, forward and backward, at microbatch size
    ``mb_size`` (and at the second sizes of a build with dynamic dimensions), and with
    ``eval_graphs`` the forward ``eval_step`` runs too (Note [compiled eval graphs]), fed as
    ``StageWorker`` feeds them (received tensors in their ``autocast`` wire dtype); each report
    gets its stage's seconds. With ``check`` each stage is then compared with its eager code
    (``CompiledMismatchError`` if it differs: Note [checking a compiled stage at the warm-up]),
    held to the tolerance of the precision it computes in: ``autocast``'s, or a half precision
    among ``fsdp_dtypes``, the names of FSDP's ``param_dtype`` and ``reduce_dtype``
    (``DataParallelOptions.shard_param_dtype``, ``shard_reduce_dtype``): gradients reduced in bf16
    are no closer than bf16. Sharded stages are warmed up after the wrap, through FSDP (Note
    [compiling under FSDP])."""
    halves = [getattr(torch, d) for d in fsdp_dtypes if d in ("bfloat16", "float16")]
    half = autocast or next(iter(halves), None)
    second = _second_sizes(manifest)  # Note [compiled dynamic dimensions]
    sizes = [None, second] if second else [None]
    traced = {r.name: r.traced for r in manifest.dynamic}  # named in a dynamic build's errors
    for report in reports:
        s, module = report.stage, stages[report.stage]
        spec = manifest.stage(s)
        mutated = [i for i, t in enumerate(spec.inputs) if t.name in spec.mutated_inputs]
        inputs = functools.partial(_warm_inputs, manifest, s, mb_size, device, autocast=autocast)
        start, failed = time.perf_counter(), len(split_failures)
        for at in sizes:
            _warm_up(module, inputs(at), s in recompute, mutated=mutated)
        report.one_graph += split_failures[failed:]  # compiled at the warm-up's backward
        # Note [checking a compiled stage at the warm-up]; sharded or split stages too: Note
        # [checking sharded stages]; a dynamic build's graphs at its second sizes too
        checked = functools.partial(
            _checked, s, module, inputs, sizes, traced, s in recompute, mutated, half
        )
        if check:
            report.check = checked(training=True)
        if eval_graphs:  # Note [compiled eval graphs]
            trained = time.perf_counter()
            for at in sizes:
                _warm_up(module, inputs(at), False, training=False, mutated=mutated)
            report.eval_seconds = time.perf_counter() - trained
            if check:
                report.eval_check = checked(training=False)
        report.seconds = time.perf_counter() - start


def _checked(
    stage: int,
    module: nn.Module,
    inputs: Callable[[Mapping[str, int] | None], list[torch.Tensor]],
    sizes: Sequence[Mapping[str, int] | None],
    traced: Mapping[str, int],
    recompute: bool,
    mutated: Sequence[int],
    half: torch.dtype | None,
    training: bool,
) -> EagerCheck:
    """``check_against_eager`` of ``stage`` (train or eval graphs) on the warm-up's inputs at each
    of ``sizes`` (a dynamic build's errors name them: ``traced`` for the traced ones), until one
    draws random numbers; ``CompiledMismatchError`` at the first that differs."""
    for at in sizes:
        check = check_against_eager(
            module, inputs(at), recompute and training, mutated, half, training=training
        )
        if not check.ok:
            batchnorm = training and _normalizes(module)
            text = _mismatch_text(stage, check, at or traced, training, batchnorm)
            raise CompiledMismatchError(text)
        if check.random:
            break
    return check
