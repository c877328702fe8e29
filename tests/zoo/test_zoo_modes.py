"""The zoo in eval mode (and train mode, from the same seed): chained stages equal the original, call after call.

For each zoo model with dropout or stochastic depth (``DROPOUT = True``), ``fxpipe partition``'s
path (trace, plan with the CLI's solver choice, write the build, which runs the safety net)
and then ``compare.py`` against ``build_model()`` with the build's weights: outputs, gradients
and buffers in eval mode and in train mode.

By default one model runs (BART: encoder-decoder, and the plan that once drew random numbers
out of order); ``FXPIPE_ZOO=all`` runs every one at 2 and 4 stages, ``FXPIPE_ZOO=name,name``
the ones named (the zoo target of CI).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from compare import compare_pipeline
from registry import zoo_models

from fxpipe.codegen import write_build_dir
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import CostModel, plan_partition
from fxpipe.tracer import trace_model_file

_WANTED = os.environ.get("FXPIPE_ZOO", "bart")
_MODELS = [m for m in zoo_models() if m.dropout and (_WANTED == "all" or m.name in _WANTED.split(","))]
_STAGES = (2, 4) if _WANTED == "all" else (2,)
MICROBATCH = 2


@pytest.mark.slow
@pytest.mark.parametrize("stages", _STAGES)
@pytest.mark.parametrize("model", _MODELS, ids=lambda m: m.name)
def test_zoo_model_is_exact_in_eval_and_train_mode(tmp_path: Path, model, stages: int) -> None:
    source = load_model_file(model.path, model_fn=model.model_fn)
    traced = trace_model_file(source, MICROBATCH, progress=False)
    plan = plan_partition(traced.profile, stages, microbatches=stages, cost=CostModel.preset("loopback"),
                          time_limit=2.0)
    out = tmp_path / "build"
    write_build_dir(traced, plan, out, source, batch_size=MICROBATCH * stages, microbatches=stages)
    for training in (False, True):
        result = compare_pipeline(out, source, training)
        assert result.ok, f"{model.name} ({'train' if training else 'eval'} mode, {stages} stages): {result}"
