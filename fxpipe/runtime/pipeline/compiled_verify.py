"""``fxpipe verify --compile``: the build's stages, compiled as ``fxpipe run --compile`` compiles
them, against the original model in one process.

A compiler can compute something other than the code it compiles. Inductor's CPU backend in torch
2.13 gives the zoo's Falcon (multi-query attention: the key and value picked out of the fused
projection with a list index, ``qkv[..., [-2], :]``, then ``scaled_dot_product_attention``)
gradients 2% off in its attention's projection, where the eager stages equal an fp64 run to
1e-8; the same model under plain ``torch.compile``, with no pipeline, is off alike, and without
vectorized kernels (``cpp.simdlen=0``) or with one thread it is right; with AVX2 kernels the
gradients are NaN (docs/compile.md: which kernels inductor emits depends on the CPU and the
threads). A run checks each stage against its eager code at its warm-up (Note [checking a
compiled stage at the warm-up] in ``compiled_check``), but not a stage with dropout, as Falcon's
are. So before a long compiled
run, ``fxpipe verify BUILD --compile`` checks what the compiled stages compute, by the rule the
eager check uses (Note [one comparison rule] in ``fxpipe.codegen.check.equivalence``), in train
and eval mode.

Dropout draws inductor's own random numbers in a compiled graph, which no eager run can match; the
stages are therefore compiled here with ``torch._inductor.config.fallback_random`` (inductor calls
eager's random operators), so a model with dropout compares in train mode too. The rest is
compiled as a run of the build's schedule (or ``schedule``) compiles it: the scope, the backward
in halves where that schedule splits it (else one graph), the dynamic dimensions marked. The
comparison runs at the build's example sizes only: in a build with dynamic dimensions the graphs
a run compiles for other lengths are not compared. Dynamo's caches are emptied before and after
(graphs compiled under ``fallback_random`` must not serve later work in the process; graphs
compiled before in it compile again at their next call), and the AOTAutograd setting compiling
changes is put back.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
import torch.nn as nn

from fxpipe.codegen.check.verify import VerifyReport, verify_build
from fxpipe.codegen.manifest import Manifest
from fxpipe.partitioner.schedule import schedule_kind
from fxpipe.runtime.pipeline.compiled import CompiledStage, compile_rank_stages
from fxpipe.runtime.train.run_options import DEFAULT_SCHEDULE

__all__ = ["verify_compiled"]


def verify_compiled(
    build_dir: str | Path,
    scope: str,
    compile_backward: str,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    schedule: str | None = None,
) -> tuple[VerifyReport, list[CompiledStage]]:
    """``verify_build`` with every stage compiled in ``scope`` as a run of ``schedule`` (default:
    the build's) compiles it, its backward in halves or as one graph (``compile_backward``) where
    that schedule splits it, dropout drawing eager's numbers; the report and what compiling each
    stage found (graph breaks, halves that fell back)."""
    compiled: list[CompiledStage] = []

    def prepare(manifest: Manifest, stages: list[nn.Module]) -> None:
        device = next((p.device for m in stages for p in m.parameters()), torch.device("cpu"))
        split = schedule_kind(schedule or manifest.schedule or DEFAULT_SCHEDULE).split_backward
        compiled.extend(
            compile_rank_stages(
                manifest,
                dict(enumerate(stages)),
                device,
                manifest.microbatch_size,
                scope=scope,
                warm_up=False,  # the comparison's own forward and backward compile them
                split_backward=split,
                split_graphs=compile_backward == "halves",
            )
        )

    donated = torch._functorch.config.donated_buffer  # compiling a split backward turns it off
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fallback_random=True):
            report = verify_build(build_dir, rtol=rtol, atol=atol, prepare=prepare)
    finally:
        torch._dynamo.reset()
        torch._functorch.config.donated_buffer = donated
    return report, compiled
