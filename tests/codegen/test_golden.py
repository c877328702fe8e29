"""Golden files: the emitted source of small models (stage files, and ``shared.py`` with the classes several
stages use) is pinned, so emitter changes show up as diffs.

Each case splits a traced example at fixed fractions of its units (no solver), so only the
tracer and the emitter shape the files. Regenerate after an intended change with
``FXPIPE_UPDATE_GOLDEN=1 pytest tests/codegen/test_golden.py`` and review the diff of
``tests/codegen/golden/``. The line that locates the model file depends on where the
build directory is, so it is compared as ``<model file>``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from codegen_support import EXAMPLES

from fxpipe.codegen import emit_build
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model_file

GOLDEN = Path(__file__).parent / "golden"
CASES = {  # folder: (example, front end, stages)
    "branchy_3_thirds": ("branchy.py", "auto", 3),
    "gpt_symbolic_2_halves": (
        "gpt.py",
        "symbolic",
        2,
    ),  # user-defined leaf, tied embeddings, bare Parameter
    "gpt_export_2_halves": ("gpt.py", "export", 2),  # the same model through torch.export
    "hf_gpt2_2_halves": (
        "hf_models.py",
        "auto",
        2,
    ),  # transformers GPT-2 (export): blocks, masks, Conv1D
}
_MODEL_FILE_LINE = re.compile(r"import_model_module\(.*\)")


@pytest.mark.parametrize("case", sorted(CASES))
def test_stage_sources_match_golden(tmp_path: Path, case: str) -> None:
    example, frontend, stages = CASES[case]
    source = load_model_file(EXAMPLES / example)
    traced = trace_model_file(source, 2, frontend=frontend, progress=False)
    units = [u.name for u in traced.profile.units]
    stage_of_unit = {u: stages * i // len(units) for i, u in enumerate(units)}
    stage_of_node = {n: stage_of_unit[u] for n, u in traced.unit_of_node.items()}
    manifest = emit_build(
        traced.graph_module,
        traced.model,
        stage_of_node,
        stages,
        tmp_path,
        source=source,
        microbatch=2,
        batch_size=2,
        microbatches=1,
        output_spec=traced.output_spec,
        user_leaf_args=traced.user_leaf_args,
    )
    folder = GOLDEN / case
    update = os.environ.get("FXPIPE_UPDATE_GOLDEN") == "1"
    files = [sm.source for sm in manifest.stages] + (
        [manifest.shared_source] if manifest.shared_source else []
    )
    if update:
        for stale in folder.glob("*.py"):
            stale.unlink()
    for name in files:
        text = _MODEL_FILE_LINE.sub(
            "import_model_module(<model file>)", (tmp_path / name).read_text()
        )
        golden = folder / name
        if update:
            folder.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.is_file(), (
            f"{golden} is missing; run with FXPIPE_UPDATE_GOLDEN=1 to create it"
        )
        assert text == golden.read_text(), (
            f"{name} differs from {golden}; if intended, rerun with FXPIPE_UPDATE_GOLDEN=1"
        )
    assert sorted(p.name for p in folder.glob("*.py")) == sorted(files), (
        "a golden file the build no longer writes"
    )
