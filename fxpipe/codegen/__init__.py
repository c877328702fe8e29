"""Codegen: split a traced graph by a partition plan and emit one readable nn.Module file per stage.

>>> from fxpipe.codegen import write_build_dir, load_stage, load_pipeline, verify_build
>>> manifest = write_build_dir(traced, plan, "build", source, batch_size=8, microbatches=2)  # doctest: +SKIP
>>> stage = load_stage("build", 1)  # doctest: +SKIP
"""

from fxpipe.codegen.build import emit_build, write_build_dir, write_report
from fxpipe.codegen.builddir import check_build_target
from fxpipe.codegen.integrity import CheckedBuild, check_build
from fxpipe.codegen.load import load_stage, read_manifest
from fxpipe.codegen.pipeline import Pipeline, load_pipeline
from fxpipe.codegen.manifest import INPUT, MANIFEST_SCHEMA_VERSION, BoundaryTensor, Manifest, StageManifest, Tie
from fxpipe.codegen.split import SplitGraph, StageGraph, split_graph
from fxpipe.codegen.verify import VerifyReport, print_verify_report, verify_build

__all__ = [
    "INPUT", "MANIFEST_SCHEMA_VERSION",
    "BoundaryTensor", "CheckedBuild", "Manifest", "Pipeline", "SplitGraph", "StageGraph", "StageManifest", "Tie", "VerifyReport",
    "check_build", "check_build_target", "emit_build", "load_pipeline", "load_stage", "print_verify_report", "read_manifest",
    "split_graph", "verify_build", "write_build_dir", "write_report",
]
