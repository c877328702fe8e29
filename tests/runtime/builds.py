"""Real build directories (tracer → partitioner → codegen) and their one-process oracle."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from fxpipe.codegen import load_stage, write_build_dir
from fxpipe.modelfile import ModelSource, load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def make_build(
    name: str | Path,
    out_dir: Path,
    stages: int,
    batch_size: int,
    microbatches: int,
    schedule: str = "1f1b",
) -> Path:
    """Trace ``examples/<name>.py`` (or the model file ``name``, a path) at the microbatch size,
    plan ``stages`` ranks for ``schedule`` (its least stages per rank), emit into ``out_dir``."""
    source = load_model_file(name if isinstance(name, Path) else EXAMPLES / f"{name}.py")
    traced = trace_model_file(source, batch_size // microbatches)
    plan = plan_partition(traced.profile, stages, microbatches=microbatches, schedule=schedule)
    write_build_dir(traced, plan, out_dir, source, batch_size=batch_size, microbatches=microbatches)
    return out_dir


def original_model(build_dir: Path, source: ModelSource, num_stages: int) -> nn.Module:
    """The model file's model carrying the build's weights (the union of the stages' state dicts)."""
    model = source.build_model()
    state = {}
    for i in range(num_stages):
        state.update(load_stage(build_dir, i).state_dict())
    model.load_state_dict(state)
    return model
