"""Golden files: the emitted source of a small model is pinned, so emitter changes show up as diffs.

Regenerate after an intended change with ``FXPIPE_UPDATE_GOLDEN=1 pytest tests/codegen/test_golden.py``
and review the diff of ``tests/codegen/golden/``.
"""

from __future__ import annotations

import os
from pathlib import Path

from codegen_support import EXAMPLES

from fxpipe.codegen import emit_build
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model_file

GOLDEN = Path(__file__).parent / "golden"


def test_branchy_stage_sources_match_golden(tmp_path: Path) -> None:
    # a fixed split (units in thirds), so only the tracer and the emitter shape the files, not a solver
    source = load_model_file(EXAMPLES / "branchy.py")
    traced = trace_model_file(source, 2, progress=False)
    units = [u.name for u in traced.profile.units]
    stage_of_unit = {u: 3 * i // len(units) for i, u in enumerate(units)}
    stage_of_node = {n: stage_of_unit[u] for n, u in traced.unit_of_node.items()}
    manifest = emit_build(traced.graph_module, traced.model, stage_of_node, 3, tmp_path, source=source,
                          microbatch=2, batch_size=2, microbatches=1, output_spec=traced.output_spec)
    folder = GOLDEN / "branchy_3_thirds"
    update = os.environ.get("FXPIPE_UPDATE_GOLDEN") == "1"
    for sm in manifest.stages:
        text = (tmp_path / sm.source).read_text()
        golden = folder / sm.source
        if update:
            folder.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.is_file(), f"{golden} is missing; run with FXPIPE_UPDATE_GOLDEN=1 to create it"
        assert text == golden.read_text(), f"{sm.source} differs from {golden}; if intended, rerun with FXPIPE_UPDATE_GOLDEN=1"
