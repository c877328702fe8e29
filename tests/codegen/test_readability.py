"""How much of a transformers GPT-2's stage source is raw aten or frees, and how it grows with depth.

Issue 11 measured, for a GPT-2 from transformers split into 2 stages (export front end),
51% of the non-blank stage lines calling ``torch.ops.aten`` and 1.74x more lines at 8
layers than at 4; issue 34, 36% of the lines freeing values (``x = None``), most of which
left the peak as it was (Note [frees that matter]: now 13%, 0.8% aten lines before the
metadata asserts went). Run this file as a script to print the figures:

    PYTHONPATH=. python tests/codegen/test_readability.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fxpipe.codegen import write_build_dir
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_ATEN_SHARE = 0.02
MAX_GROWTH_4_TO_8 = 1.3
MAX_FREE_SHARE = 0.2


def stage_lines(layers: int, out: Path) -> list[str]:
    """Non-blank lines of the 2 stage files of a ``layers``-deep transformers GPT-2, and of the classes they share
    (``shared.py``)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import hf_models
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.manual_seed(0)
    traced = trace_model(
        hf_models.build_gpt2(layers=layers), hf_models.example_inputs(2), progress=False
    )
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    manifest = write_build_dir(traced, plan, out, None, batch_size=4, microbatches=2)
    assert manifest.frontend == "export"
    files = [sm.source for sm in manifest.stages] + (
        [manifest.shared_source] if manifest.shared_source else []
    )
    return [ln for name in files for ln in (out / name).read_text().splitlines() if ln.strip()]


def measure(root: Path) -> tuple[float, float, float]:
    """(share of lines calling torch.ops.aten at 4 layers, lines at 8 layers / lines at 4 layers,
    share of lines freeing a value at 4 layers); every class is declared once in the build."""
    four, eight = stage_lines(4, root / "four"), stage_lines(8, root / "eight")
    classes = [ln.split("(")[0] for ln in four if ln.startswith("class ")]
    assert len(classes) == len(set(classes)), f"classes declared twice: {sorted(classes)}"
    aten = sum("torch.ops.aten" in ln for ln in four) / len(four)
    frees = sum(" = None" in ln for ln in four) / len(four)
    return aten, len(eight) / len(four), frees


@pytest.mark.slow
def test_gpt2_stages_read_like_pytorch_and_do_not_grow_with_depth(tmp_path: Path) -> None:
    aten, growth, frees = measure(tmp_path)
    assert aten < MAX_ATEN_SHARE, f"{aten:.1%} of the stage lines call torch.ops.aten"
    assert growth < MAX_GROWTH_4_TO_8, f"8 layers give {growth:.2f}x the lines of 4"
    assert frees < MAX_FREE_SHARE, f"{frees:.1%} of the stage lines free a value"


if __name__ == "__main__":
    import tempfile
    import warnings

    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        share, growth, frees = measure(Path(tmp))
    print(
        f"aten lines: {share:.1%} of the non-blank stage lines (4 layers, 2 stages); "
        f"8 layers / 4 layers: {growth:.2f}x; lines freeing a value: {frees:.1%}"
    )
