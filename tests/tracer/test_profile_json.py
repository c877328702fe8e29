"""profile.json: ModelInfo from tracing, typed round trips, version 1 and the minimal profile."""

from __future__ import annotations

import json
from pathlib import Path

from example_models import EXAMPLES

from fxpipe.cli import main
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import PartitionPlan
from fxpipe.tracer import trace_model_file
from fxpipe.tracer.profile import PROFILE_SCHEMA_VERSION, ModelInfo, ModelProfile

MINIMAL = {
    "units": [
        {
            "name": f"layer{i}",
            "fwd_ms": 1.0 + i,
            "bwd_ms": 2.0,
            "param_bytes": 1000,
            "activation_bytes": 64,
            "outputs": [{"shape": [2, 8], "dtype": "float32"}],
        }
        for i in range(4)
    ],
    "edges": [{"src": f"layer{i}", "dst": f"layer{i + 1}", "bytes": 64} for i in range(3)],
    "batch_size": 2,
}


def test_traced_profile_records_model_info_and_round_trips(tmp_path: Path) -> None:
    source = load_model_file(EXAMPLES["mlp"])
    profile = trace_model_file(source, 2, progress=False).profile
    assert profile.model == ModelInfo(
        class_name=profile.model.class_name,
        file=str(source.path),
        sha256=source.sha256,
        factory="build_model",
    )
    assert profile.model.class_name and profile.model.class_name.endswith("MLP")
    assert ModelProfile.from_json(profile.to_json(tmp_path / "profile.json")) == profile
    assert (
        json.loads((tmp_path / "profile.json").read_text())["model"]["class_name"]
        == profile.model.class_name
    )


def test_version_1_profiles_are_read() -> None:
    old = dict(
        MINIMAL,
        schema_version=1,
        model={
            "class": "m.Net",
            "file": "m.py",
            "sha256": "ab",
            "factory": "build_model",
            "name": "net",
        },
    )
    profile = ModelProfile.from_dict(old)
    assert profile.model == ModelInfo(
        name="net", class_name="m.Net", file="m.py", sha256="ab", factory="build_model"
    )
    assert profile.schema_version == PROFILE_SCHEMA_VERSION == 2
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_the_minimal_profile_loads_and_plans(tmp_path: Path) -> None:
    profile = ModelProfile.from_dict(MINIMAL)
    assert [u.module_path for u in profile.units] == ["layer0", "layer1", "layer2", "layer3"]
    assert profile.model == ModelInfo() and profile.model.title == "model"
    path = tmp_path / "minimal.json"
    path.write_text(json.dumps(MINIMAL))
    assert main(["plan", str(path), "--stages", "2", "--out", str(tmp_path / "plan.json")]) == 0
    plan = PartitionPlan.from_json(tmp_path / "plan.json")
    # planned for the 1F1B step with 2 microbatches: (12 ms, 6 ms) stages take 24 ms, the least
    # bottleneck (7 ms, 11 ms) 29 ms, since the last stage runs its F and B back to back
    assert [s.units for s in plan.stages] == [("layer0", "layer1", "layer2"), ("layer3",)]
