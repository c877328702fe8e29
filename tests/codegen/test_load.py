"""load_stage: hash checks before any code runs, clear errors, and memory of about one stage."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from codegen_support import example_build  # noqa: F401 (fixture)

from fxpipe.codegen import load_stage, read_manifest
from fxpipe.errors import BuildDirError


@pytest.fixture
def mlp_build(example_build):
    return example_build("mlp", 3, solver="uniform")


def test_load_stage_builds_only_its_stage(mlp_build) -> None:
    manifest, source, out = mlp_build
    stage = load_stage(out, 1)
    assert type(stage).__name__ == "Stage1"
    assert set(stage.state_dict()) == set(
        manifest.stages[1].parameters + manifest.stages[1].buffers
    )
    assert all(p.device.type == "cpu" and not p.is_meta for p in stage.parameters())
    x = torch.randn(5, *manifest.stages[1].inputs[0].shape[1:])
    (y,) = stage(x)
    assert y.shape[0] == 5


def test_tampered_source_is_refused_before_it_runs(mlp_build, tmp_path: Path) -> None:
    _, _, out = mlp_build
    marker = tmp_path / "marker"
    with open(out / "stage_2.py", "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(BuildDirError, match="stage_2.py has sha256"):
        load_stage(out, 2)
    assert not marker.exists()


def test_tampered_weights_are_refused(mlp_build) -> None:
    _, _, out = mlp_build
    data = bytearray((out / "stage_0.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "stage_0.safetensors").write_bytes(bytes(data))
    with pytest.raises(BuildDirError, match="stage_0.safetensors has sha256"):
        load_stage(out, 0)


def test_missing_files_schema_and_index(mlp_build, tmp_path: Path) -> None:
    manifest, _, out = mlp_build
    with pytest.raises(BuildDirError, match="out of range.*3 stages"):
        load_stage(out, 3)
    (out / "stage_1.safetensors").unlink()
    with pytest.raises(BuildDirError, match="missing"):
        load_stage(out, 1)
    data = json.loads((out / "manifest.json").read_text())
    data["schema_version"] = 99
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BuildDirError, match="schema version 99"):
        read_manifest(out)
    with pytest.raises(BuildDirError, match="does not exist"):
        load_stage(tmp_path / "nowhere", 0)


def _load_benchmark() -> Any:
    """``benchmarks/load/run.py``: its big-MLP model file and its peak-RSS measurement, so the
    test checks exactly what the benchmark reports."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "load" / "run.py"
    spec = importlib.util.spec_from_file_location("fxpipe_benchmark_load", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_last_stage_loads_in_well_under_half_the_memory(tmp_path: Path) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    bench = _load_benchmark()
    path = tmp_path / "big_mlp.py"
    path.write_text(
        bench.MODEL.format(width=2048, layers=16)
    )  # 16 x 16.8 MB = 268 MB of fp32 weights
    source = load_model_file(path)
    traced = trace_model_file(source, 1, progress=False)
    plan = plan_partition(traced.profile, 4, solver="uniform")
    write_build_dir(traced, plan, tmp_path / "build", source, batch_size=1, microbatches=1)
    del traced
    whole, _ = bench.measure("model", str(path))  # peak RSS growth in MiB, in a fresh process
    last, _ = bench.measure("stage", str(tmp_path / "build"), "3")
    assert whole > 200, whole  # sanity: the model really is hundreds of MB
    assert last < 0.4 * whole, (last, whole)
