"""``RunRecord`` (run.json) and the plan's predicted step that it reports."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fxpipe.codegen.manifest import Manifest, StageManifest
from fxpipe.errors import BuildDirError
from fxpipe.modelfile import file_sha256
from fxpipe.partitioner import plan_partition
from fxpipe.runtime.train.run_record import RunRecord, read_build_plan
from fxpipe.tracer import ModelProfile, Unit, UnitEdge

# the fields run.json has (the record adds schema_version); build_sha256 and stopped since issue 35,
# compile_seconds since issue 39
RUN_JSON_FIELDS = {
    "losses",
    "step_seconds",
    "median_step_ms",
    "samples_per_second",
    "schedule",
    "microbatches",
    "batch_size",
    "lr",
    "world_size",
    "num_stages",
    "device",
    "backend",
    "predicted_step_ms",
    "peak_memory_bytes",
    "peak_tensor_bytes",
    "dp",
    "global_batch_size",
    "comm_hook",
    "powersgd_rank",
    "shard_optimizer_state",
    "backward_passes_per_step",
    "optimizer",
    "precision",
    "lrs",
    "grad_norms",
    "eval_losses",
    "first_step",
    "build_sha256",
    "stopped",
    "compile_seconds",
}

RECORD = RunRecord(
    losses=(2.0, 1.5),
    step_seconds=(0.2, 0.1),
    median_step_ms=100.0,
    samples_per_second=80.0,
    schedule="1f1b",
    microbatches=2,
    batch_size=8,
    lr=0.01,
    world_size=2,
    num_stages=2,
    device="cpu",
    backend="gloo",
    predicted_step_ms=None,
    peak_memory_bytes=(1 << 30, 1 << 30),
    peak_tensor_bytes=(1 << 20, 1 << 21),
    dp=1,
    global_batch_size=8,
    comm_hook="allreduce",
    powersgd_rank=1,
    shard_optimizer_state=False,
    backward_passes_per_step=1,
)


def test_run_json_round_trip_keeps_every_field(tmp_path: Path) -> None:
    RECORD.to_json(tmp_path / "run.json")
    data = json.loads((tmp_path / "run.json").read_text())
    assert set(data) == RUN_JSON_FIELDS | {"schema_version"} and data["schema_version"] == 1
    assert data["losses"] == [2.0, 1.5] and data == RECORD.to_dict()
    assert RunRecord.from_json(tmp_path / "run.json") == RECORD
    del data["schema_version"]  # a run.json written before the record had a version reads the same
    assert RunRecord.from_dict(data) == RECORD


def test_bad_run_json_is_refused() -> None:
    with pytest.raises(BuildDirError, match="run.json schema version 2 is newer"):
        RunRecord.from_dict({**RECORD.to_dict(), "schema_version": 2})
    with pytest.raises(BuildDirError, match="run.json: missing the field .losses."):
        RunRecord.from_dict({k: v for k, v in RECORD.to_dict().items() if k != "losses"})


def test_the_build_plan_is_read_and_checked_before_training(tmp_path: Path) -> None:
    # which configurations the prediction applies to: tests/partitioner/test_plan_json.py
    stage = StageManifest(0, "Stage0", "stage_0.py", "stage_0.safetensors", "", "", (), ())
    manifest = Manifest(
        model_file="",
        model_fn="",
        model_sha256="",
        stages=(stage,),
        batch_size=2,
        microbatch_size=1,
    )
    manifest.to_json(tmp_path / "manifest.json")
    assert read_build_plan(tmp_path) is None  # a build without plan.json trains, with no prediction
    profile = ModelProfile(
        units=(Unit("a", "a", fwd_ms=1.0, bwd_ms=2.0), Unit("b", "b", fwd_ms=1.0, bwd_ms=2.0)),
        edges=(UnitEdge("a", "b", 64),),
        batch_size=2,
    )
    plan = plan_partition(profile, 2, microbatches=2)
    plan.to_json(tmp_path / "plan.json")
    replace(manifest, plan_sha256=file_sha256(tmp_path / "plan.json")).to_json(
        tmp_path / "manifest.json"
    )
    loaded = read_build_plan(tmp_path)
    assert loaded == plan and loaded.predicted_step_ms("1f1b", microbatches=2) == plan.step_ms
    data = json.loads((tmp_path / "plan.json").read_text())
    data["prediction"]["step_ms"]["1f1b"] = "fast"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(
        BuildDirError, match=r"plan plan.json has sha256 .* changed after it was built"
    ):
        read_build_plan(tmp_path)
    manifest.to_json(
        tmp_path / "manifest.json"
    )  # a build written before plan.json was hashed: still validated
    with pytest.raises(
        BuildDirError, match=r"plan.json: plan prediction.step_ms\['1f1b'\]: expected a number"
    ):
        read_build_plan(tmp_path)


def test_run_json_into_a_removed_build_directory_is_one_error(tmp_path: Path) -> None:
    """A build directory removed while the job ran: a BuildDirError naming it, not an internal FileNotFoundError."""
    with pytest.raises(
        BuildDirError,
        match=r"its folder .*gone.* no longer exists \(was it removed while the job ran",
    ):
        RECORD.to_json(tmp_path / "gone" / "run.json")
