"""``make_build``: a small build of a model file's text, the probes' starting point.

A module of its own (not the folder's conftest) so a probe imports it by a name no other test
folder uses.
"""

from __future__ import annotations

import warnings
from pathlib import Path


def make_build(folder: Path, model_text: str, stages: int = 2) -> Path:
    """``folder/model.py`` and its build ``folder/build`` (batch 4, 2 microbatches), inside a project
    folder so the manifest names the model file relative to the build and a copy moves both."""
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text("")
    (folder / "model.py").write_text(model_text)
    source = load_model_file(folder / "model.py")
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # "symbolic tracing failed inside 'Scale': keeping it whole"
        traced = trace_model_file(source, 2, progress=False)
    plan = plan_partition(traced.profile, stages, microbatches=2)
    write_build_dir(traced, plan, folder / "build", source, batch_size=4, microbatches=2)
    return folder / "build"
