"""Codegen: split a traced graph by a partition plan and emit one readable nn.Module file per stage.

Names load on first use, so a worker that only loads stages (``load_stage``, ``read_manifest``)
does not import the emitter.

>>> from fxpipe.codegen import write_build_dir, load_stage, load_pipeline, verify_build
>>> manifest = write_build_dir(traced, plan, "build", source, batch_size=8, microbatches=2)  # doctest: +SKIP
>>> stage = load_stage("build", 1)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe._lazy import lazy_exports, type_checking_exports

if TYPE_CHECKING:
    from fxpipe.codegen.build import emit_build, write_build_dir, write_report
    from fxpipe.codegen.builddir import check_build_target
    from fxpipe.codegen.integrity import CheckedBuild, check_build
    from fxpipe.codegen.load import load_stage, read_manifest
    from fxpipe.codegen.manifest import (
        INPUT,
        MANIFEST_SCHEMA_VERSION,
        BoundaryTensor,
        Manifest,
        StageManifest,
        Tie,
    )
    from fxpipe.codegen.pipeline import Pipeline, load_pipeline
    from fxpipe.codegen.graph.split import SplitGraph, StageGraph, split_graph
    from fxpipe.codegen.check.verify import VerifyReport, print_verify_report, verify_build

# the names above, imported on first use (Note [one list of lazy names] in fxpipe._lazy)
_LAZY = type_checking_exports(__file__)
__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
