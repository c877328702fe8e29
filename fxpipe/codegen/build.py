"""Write a whole build directory, atomically: stages, weights, manifest, plan, profile and report.

``write_build_dir`` takes the tracer's ``TracedModel`` and the partitioner's plan and
writes every file of a build (the layout in ARCHITECTURE.md); ``emit_build`` is the
same step on plain inputs (a normalized graph module, its model and a node -> stage
map) and writes the stages and the manifest, which is what tests and other tools can
call. Both write into a sibling folder and swap it in only when complete (Note [build
directory swap] in ``fxpipe.codegen.builddir``): a failure leaves the previous build
as it was, and a new build leaves no stale file of the old one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.graphmeta import CONSTANTS_KEY
from fxpipe.codegen.builddir import replace_file, staged_build_dir
from fxpipe.codegen.checkpoint_weights import (
    MetaWeights,
    build_meta_weights,
    meta_skipped_checks,
    write_meta_stage,
)
from fxpipe.codegen.render.emit import emit_stages
from fxpipe.codegen.manifest import Manifest, StageManifest, model_file_reference
from fxpipe.codegen.outputs import dump_output_spec
from fxpipe.codegen.check.safety import check_equivalence
from fxpipe.codegen.shared import SHARED_SOURCE
from fxpipe.codegen.graph.split import SplitGraph, split_graph
from fxpipe.codegen.tp_plan import write_tp_plan
from fxpipe.codegen.graph.ownership import (
    BUFFER,
    CONSTANT,
    PARAMETER,
    alias_chooser,
    save_weights,
    stage_state,
    tied_groups,
)
from fxpipe.errors import CodegenError
from fxpipe.modelfile import ModelSource, file_sha256
from fxpipe.tracer.progress import phase

if TYPE_CHECKING:
    from fxpipe.partitioner.plan import PartitionPlan
    from fxpipe.partitioner.report.terminal import Measurement
    from fxpipe.tracer.call import CallSpec
    from fxpipe.tracer.profile import ModelProfile
    from fxpipe.tracer.traced import TracedModel

__all__ = ["write_build_dir", "emit_build", "write_report"]


def write_build_dir(
    traced: TracedModel,
    plan: PartitionPlan,
    out_dir: str | Path,
    source: ModelSource | None,
    *,
    batch_size: int,
    microbatches: int,
    check: bool = True,
    weights: str | Path | None = None,
) -> Manifest:
    """Write the whole build directory of ``plan`` for ``traced`` to ``out_dir``; return its manifest.

    ``out_dir`` gets ``stage_<i>.py``, ``stage_<i>.safetensors`` (one pair per stage: with
    ``plan.virtual_stages`` V > 1 the stages are chunks, V per rank, and the manifest records
    each one's rank and the plan's schedule), ``shared.py`` when a generated class is used by several
    stages (Note [classes several stages share] in ``fxpipe.codegen.shared``), ``manifest.json``,
    ``plan.json``, ``profile.json``, ``report.html`` and ``tp_plan.json``
    (``fxpipe.codegen.tp_plan``), and nothing else: it is replaced as a whole once every file is
    written (a failure leaves it as it was). An ``out_dir`` that is a file, is not writable, or
    holds files of its own is a BuildDirError.
    ``batch_size`` is one pipeline replica's batch, cut into ``microbatches``; the model
    was traced at the microbatch size ``batch_size // microbatches``. With ``check`` (the
    default) the staged stages must equal the model in train and eval mode before the build
    replaces ``out_dir`` (Note [safety net] in ``fxpipe.codegen.check.safety``; ``EquivalenceError``).
    A model traced on meta has no values: its stages' tensors come from the checkpoint
    ``weights``, or, without one, are initialised by ``load_stage``, and the safety net cannot
    run (listed in ``manifest.skipped_checks``; Note [stage weights from a checkpoint] in
    ``fxpipe.codegen.checkpoint_weights``).

    Example::

        manifest = write_build_dir(traced, plan, "build", source, batch_size=8, microbatches=2)
    """
    from fxpipe.partitioner.report.html import render_html_report

    units_of_stage = [tuple(st.units) for st in plan.stages]
    stage_of_unit = {u: s for s, units in enumerate(units_of_stage) for u in units}
    missing = sorted({u for u in traced.unit_of_node.values() if u not in stage_of_unit})
    if missing:
        raise CodegenError(
            f"the plan places no stage for units {missing[:5]} of the traced model; "
            "was it planned from another profile?"
        )
    stage_of_node = {n: stage_of_unit[u] for n, u in traced.unit_of_node.items()}
    traced_mb = traced.profile.batch_size
    if traced.static_batch and microbatches and batch_size != traced_mb * microbatches:
        raise CodegenError(  # Note [a batch the model fixes]
            f"{traced.static_batch} fixes the batch, so the model was traced static at microbatch "
            f"{traced_mb}; a batch of {batch_size} in {microbatches} microbatches does not give "
            f"{traced_mb}: use --batch-size {traced_mb * microbatches}"
        )
    meta = build_meta_weights(traced, weights)
    with staged_build_dir(out_dir) as staging:
        with phase("emit") as emitted:
            emitted.detail = f"{plan.num_stages} stages"
            manifest, split = _emit_files(
                traced.graph_module,
                traced.model,
                stage_of_node,
                plan.num_stages,
                Path(out_dir),
                staging,
                source=source,
                microbatch=traced.profile.batch_size,
                batch_size=batch_size,
                microbatches=microbatches,
                user_leaf_args=traced.user_leaf_args,
                output_spec=traced.output_spec,
                frontend=traced.frontend,
                units_of_stage=units_of_stage,
                call=traced.call,
                stage_ranks=plan.stage_ranks,
                schedule=plan.schedule,
                meta_weights=meta,
            )
            plan.to_json(staging / "plan.json")
            manifest = replace(
                manifest,
                plan_sha256=file_sha256(staging / "plan.json"),  # checked before it is read
                static_batch=traced.static_batch,
                dynamic=traced.profile.dynamic,  # Note [shape formulas]
                recomputed_buffers=traced.profile.recomputed_buffers,  # Note [computed buffers on meta]
            )
            manifest.to_json(staging / "manifest.json")
            traced.profile.to_json(staging / "profile.json")
            (staging / "report.html").write_text(
                render_html_report(plan, traced.profile), encoding="utf-8"
            )
        if (
            check and meta is None
        ):  # before the swap: a refused build leaves the previous one in place
            with phase("check"):
                check_equivalence(staging, manifest, traced, split.sources)
        write_tp_plan(staging, manifest.num_stages)  # fxpipe.codegen.tp_plan
    return manifest


def write_report(
    build_dir: str | Path,
    plan: PartitionPlan,
    profile: ModelProfile,
    measured: Measurement | None = None,
) -> Path:
    """(Re)write ``report.html`` of ``build_dir`` whole (``fxpipe report --html``), with a run's
    ``measured`` figures beside the prediction; return its path."""
    from fxpipe.partitioner.report.html import render_html_report

    path = Path(build_dir) / "report.html"
    replace_file(path, render_html_report(plan, profile, measured))
    return path


def emit_build(
    gm: fx.GraphModule,
    model: nn.Module,
    stage_of_node: Mapping[str, int],
    num_stages: int,
    out_dir: str | Path,
    *,
    source: ModelSource | None,
    microbatch: int,
    batch_size: int,
    microbatches: int,
    user_leaf_args: Mapping[str, tuple[tuple, dict]] | None = None,
    output_spec: Any = None,
    frontend: str = "symbolic",
    units_of_stage: list[tuple[str, ...]] | None = None,
    call: CallSpec | None = None,
    stage_ranks: tuple[int, ...] | None = None,
    schedule: str | None = None,
) -> Manifest:
    """Split ``gm`` by ``stage_of_node`` and write the stages and the manifest to ``out_dir``,
    replacing it as a whole (see ``write_build_dir``). ``call``: how the model's call binds to
    the graph's placeholders (``TracedModel.call``; ``None``: positionally). ``stage_ranks``: the
    pipeline rank of each stage (default: stage i on rank i)."""
    with staged_build_dir(out_dir) as staging:
        return _emit_files(
            gm,
            model,
            stage_of_node,
            num_stages,
            Path(out_dir),
            staging,
            source=source,
            microbatch=microbatch,
            batch_size=batch_size,
            microbatches=microbatches,
            user_leaf_args=user_leaf_args,
            output_spec=output_spec,
            frontend=frontend,
            units_of_stage=units_of_stage,
            call=call,
            stage_ranks=stage_ranks,
            schedule=schedule,
        )[0]


def _emit_files(
    gm: fx.GraphModule,
    model: nn.Module,
    stage_of_node: Mapping[str, int],
    num_stages: int,
    out: Path,
    staging: Path,
    *,
    source: ModelSource | None,
    microbatch: int,
    batch_size: int,
    microbatches: int,
    user_leaf_args: Mapping[str, tuple[tuple, dict]] | None,
    output_spec: Any,
    frontend: str,
    units_of_stage: list[tuple[str, ...]] | None,
    call: CallSpec | None,
    stage_ranks: tuple[int, ...] | None = None,
    schedule: str | None = None,
    meta_weights: MetaWeights | None = None,
) -> tuple[Manifest, SplitGraph]:
    """Write the stage files and the manifest into ``staging``; paths in them are relative to
    ``out``, the directory ``staging`` becomes. Returns the manifest and the split it was written from."""
    if batch_size != microbatch * microbatches:
        raise CodegenError(
            f"the model was traced at microbatch {microbatch}, but batch_size {batch_size} / "
            f"microbatches {microbatches} is not that; trace at batch_size // microbatches"
        )
    split = split_graph(gm, stage_of_node, num_stages, alias_chooser(gm, model))
    constants = set(gm.meta.get(CONSTANTS_KEY, ()))
    order = {p: i for i, (p, _) in enumerate(model.named_modules(remove_duplicate=False))}
    label = f"{source.model_fn}() in {source.path.name}" if source else type(model).__name__
    states = [stage_state(gm, model, sg.modules, sg.attrs, constants) for sg in split.stages]
    sources, shared = emit_stages(
        split,
        states,
        gm,
        microbatch=microbatch,
        model_label=label,
        user_leaf_args=user_leaf_args or {},
        module_order=order,
        model=model,
        build_dir=out,
    )
    shared_sha256 = ""
    if shared is not None:  # Note [classes several stages share]
        (staging / SHARED_SOURCE).write_text(shared.text)
        shared_sha256 = file_sha256(staging / SHARED_SOURCE)
    stages = []
    for sg, state, src in zip(split.stages, states, sources):
        py, st = staging / f"stage_{sg.index}.py", staging / f"stage_{sg.index}.safetensors"
        py.write_text(src.text)
        if meta_weights is None:
            save_weights(state, st)
        else:
            write_meta_stage(state, st, meta_weights)
        units = units_of_stage[sg.index] if units_of_stage else ()
        stages.append(
            StageManifest(
                index=sg.index,
                class_name=src.class_name,
                source=py.name,
                weights=st.name,
                source_sha256=file_sha256(py),
                weights_sha256=file_sha256(st),
                inputs=tuple(split.boundary[k] for k in sg.inputs),
                outputs=tuple(split.boundary[k] for k in sg.outputs),
                parameters=state.keys(PARAMETER),
                buffers=state.keys(BUFFER),
                constants=state.keys(CONSTANT),
                units=tuple(units),
                mutated_inputs=sg.mutated,
                imports_shared=src.imports_shared,
                imports_model_file=src.imports_model_file
                or (src.imports_shared and shared is not None and shared.imports_model_file),
                rank=stage_ranks[sg.index]
                if stage_ranks and stage_ranks[sg.index] != sg.index
                else None,
            )
        )
    spec_json, output_modules = dump_output_spec(output_spec)
    manifest = Manifest(
        model_file=model_file_reference(source.path, out) if source else "",
        model_fn=source.model_fn if source else "",
        model_sha256=source.sha256 if source else "",
        stages=tuple(stages),
        batch_size=batch_size,
        microbatch_size=microbatch,
        inputs=tuple(split.boundary[k] for k in split.model_inputs),
        ties=tied_groups(states),
        inputs_fn=source.inputs_fn if source else "example_inputs",
        frontend=frontend,
        output_spec=spec_json,
        output_modules=output_modules,
        call=call,
        microbatches=microbatches,
        training=model.training,
        torch_version=torch.__version__,
        schedule=schedule,
        weights=meta_weights.source if meta_weights else "model",
        skipped_checks=meta_skipped_checks(meta_weights),
        init_models=meta_weights.init_models if meta_weights else (),
        shared_source=SHARED_SOURCE if shared is not None else "",
        shared_sha256=shared_sha256,
    )
    manifest.to_json(staging / "manifest.json")
    return manifest, split
