"""``RunRecord`` (run.json) and the plan's predicted step that it reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxpipe.errors import BuildDirError
from fxpipe.runtime.record import RunRecord, predicted_step_ms

# the fields run.json has always had (the record adds schema_version)
RUN_JSON_FIELDS = {"losses", "step_seconds", "median_step_ms", "samples_per_second", "schedule", "microbatches",
                   "batch_size", "lr", "world_size", "num_stages", "device", "backend", "predicted_step_ms",
                   "peak_memory_bytes", "peak_tensor_bytes", "dp", "global_batch_size", "comm_hook", "powersgd_rank",
                   "shard_optimizer_state", "backward_passes_per_step"}

RECORD = RunRecord(
    losses=(2.0, 1.5), step_seconds=(0.2, 0.1), median_step_ms=100.0, samples_per_second=80.0, schedule="1f1b",
    microbatches=2, batch_size=8, lr=0.01, world_size=2, num_stages=2, device="cpu", backend="gloo",
    predicted_step_ms=None, peak_memory_bytes=(1 << 30, 1 << 30), peak_tensor_bytes=(1 << 20, 1 << 21), dp=1,
    global_batch_size=8, comm_hook="allreduce", powersgd_rank=1, shard_optimizer_state=False,
    backward_passes_per_step=1)


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
    with pytest.raises(BuildDirError, match="run.json is malformed: .*losses"):
        RunRecord.from_dict({k: v for k, v in RECORD.to_dict().items() if k != "losses"})


def test_predicted_step_is_only_reported_for_the_plans_replicas_and_hook(tmp_path: Path) -> None:
    plan = {"microbatches": 2, "cost": {"dp_replicas": 2, "comm_hook": "fp16"},
            "prediction": {"step_ms": {"1f1b": 3.5}}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert predicted_step_ms(tmp_path, "1f1b", 2, dp=2, comm_hook="fp16") == 3.5
    assert predicted_step_ms(tmp_path, "1f1b", 2, dp=2, comm_hook="allreduce") is None
    assert predicted_step_ms(tmp_path, "1f1b", 2) is None  # priced for 2 replicas, run with 1
    assert predicted_step_ms(tmp_path, "1f1b", 4, dp=2, comm_hook="fp16") is None
    plan["cost"] = {"dp_replicas": 2, "comm_hook": "powersgd", "powersgd_rank": 1}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert predicted_step_ms(tmp_path, "1f1b", 2, dp=2, comm_hook="powersgd", powersgd_rank=1) == 3.5
    assert predicted_step_ms(tmp_path, "1f1b", 2, dp=2, comm_hook="powersgd", powersgd_rank=4) is None
