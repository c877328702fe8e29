"""A model that fixes its batch size (issue 37 item 3; Note [a batch the model fixes]).

CLIP's loss ``cross_entropy(logits, torch.arange(len(logits)))`` makes the batch a constant:
torch.export stops at "Constraints violated (batch)!" without saying where. fxpipe names the
line, traces static at the microbatch size, says so, records it in the build, verifies one
microbatch, and refuses a microbatch of another size (the pipeline and the runtime alike),
naming the batch that works.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpipe.codegen import load_pipeline, verify_build, write_build_dir
from fxpipe.errors import CodegenError, ConfigError
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

MODEL = Path(__file__).resolve().parent / "static_batch_model.py"
LINE = r"static_batch_model\.py:\d+ \(`return F\.cross_entropy\(logits, torch\.arange\(len\(logits\)\)\)"


def test_the_line_that_fixes_the_batch_is_named_and_the_build_is_static(tmp_path: Path) -> None:
    source = load_model_file(MODEL)
    with pytest.warns(UserWarning, match=LINE + r".*traced static at the microbatch size 3"):
        traced = trace_model_file(source, 3, frontend="export", progress=False)
    assert "static_batch_model.py" in traced.static_batch
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    with pytest.raises(CodegenError, match=r"traced static at microbatch 3.*--batch-size 6"):
        write_build_dir(traced, plan, tmp_path / "bad", source, batch_size=8, microbatches=2)
    build = tmp_path / "build"
    manifest = write_build_dir(traced, plan, build, source, batch_size=6, microbatches=2)
    assert "static_batch_model.py" in manifest.static_batch
    assert verify_build(build).ok
    pipeline = load_pipeline(build)
    model = source.build_model()
    torch.testing.assert_close(
        pipeline(*source.example_inputs(3)), model(*source.example_inputs(3))
    )
    with pytest.raises(
        ConfigError, match=r"exactly 3 samples, not 4: " + LINE + r".*--batch-size 6"
    ):
        pipeline(*source.example_inputs(4))
    with pytest.raises(ConfigError, match="exactly 3 samples, not 6"):
        manifest.check_static_batch(6)  # what the runtime calls on each step's microbatch size
