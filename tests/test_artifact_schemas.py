"""Every artifact read at the boundary: bad profile, plan and manifest files give one clear line.

Each variant changes one thing in a valid file (a wrong type, ``NaN``/``Infinity``, a
negative size, a missing or null field, an inconsistent value, a bad schema version)
and must fail with one ``ProfileError``/``PartitionError``/``BuildDirError`` line that
names the field, both from Python and through the CLI (exit 2, no traceback).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fxpipe.cli import main
from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest, Tie
from fxpipe.errors import BuildDirError, FxpipeError, PartitionError, ProfileError
from fxpipe.partitioner import PartitionPlan, plan_partition
from fxpipe.tracer.profile import ModelProfile

MINIMAL_PROFILE: dict[str, Any] = {  # the ARCHITECTURE.md "Minimal JSON fields", nothing more
    "units": [
        {
            "name": n,
            "fwd_ms": f,
            "bwd_ms": 2 * f,
            "param_bytes": p,
            "activation_bytes": 100,
            "outputs": [{"shape": [1, 16], "dtype": "float32"}],
        }
        for n, f, p in (
            ("embed", 1.0, 4000),
            ("block1", 2.0, 8000),
            ("block2", 2.0, 8000),
            ("head", 1.0, 4000),
        )
    ],
    "edges": [
        {"src": a, "dst": b, "bytes": 64}
        for a, b in (("embed", "block1"), ("block1", "block2"), ("block2", "head"))
    ],
    "batch_size": 1,
}


def _plan_dict() -> dict[str, Any]:
    return plan_partition(ModelProfile.from_dict(MINIMAL_PROFILE), 2, microbatches=2).to_dict()


def _manifest() -> Manifest:
    x = BoundaryTensor("x", (2, 8), "float32", 0, INPUT, (0,), False)
    h = BoundaryTensor("h", (2, 8), "float32", 0, 0, (1,), True)
    y = BoundaryTensor("y", (2, 8), "float32", 0, 1, (), True, 0)
    stages = (
        StageManifest(
            0, "Stage0", "stage_0.py", "stage_0.safetensors", "ab", "cd", (x,), (h,), ("0.weight",)
        ),
        StageManifest(
            1, "Stage1", "stage_1.py", "stage_1.safetensors", "ef", "01", (h,), (y,), ("1.weight",)
        ),
    )
    return Manifest(
        model_file="model.py",
        model_fn="build_model",
        model_sha256="ff",
        stages=stages,
        batch_size=4,
        microbatch_size=2,
        inputs=(x,),
        ties=(Tie((0, 1), ("0.weight", "1.weight")),),
        microbatches=2,
        training=True,
        torch_version="2.13.0",
    )


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change that sets ``path`` (dots and [i]) of the JSON object to ``value``."""
    keys: list[Any] = [
        int(k) if k.isdigit() else k for k in path.replace("[", ".").replace("]", "").split(".")
    ]

    def change(data: dict[str, Any]) -> None:
        node: Any = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value

    return change


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda data: data.pop(key)


PROFILE_CASES = [
    (_set("units[1].fwd_ms", "fast"), "profile units[1].fwd_ms: expected a number, got 'fast'"),
    (_set("edges", None), "profile edges: expected a list, got null"),
    (_set("units[0]", 5), "profile units[0]: expected an object, got 5"),
    (
        _set("units[2].bwd_ms", math.nan),
        "profile units[2].bwd_ms: expected a finite number, got NaN",
    ),
    (
        _set("units[0].param_bytes", -1),
        "profile units[0].param_bytes: expected an integer >= 0, got -1",
    ),
    (
        _set("units[0].activation_bytes", 1.5),
        "profile units[0].activation_bytes: expected an integer, got 1.5",
    ),
    (_set("batch_size", 0), "profile batch_size: expected an integer >= 1, got 0"),
    (
        _set("units[0].outputs[0].shape", ["a"]),
        "profile units[0].outputs[0].shape[0]: expected an integer, got 'a'",
    ),
    (
        _set("units[0].outputs[0]", {"dtype": "float32"}),
        "profile units[0].outputs[0]: missing the field 'shape'",
    ),
    (
        _set("units[0].outputs[0].dtype", "float33"),
        "profile units[0].outputs[0]: unknown dtype 'float33'",
    ),
    (_set("edges[0].bytes", math.inf), "profile edges[0].bytes: expected an integer, got Infinity"),
    (_set("edges[1].dst", "nope"), "profile: edge block1->nope names unknown unit 'nope'"),
    (_set("units[1].name", 7), "profile units[1].name: expected a string, got 7"),
    (_set("model", "gpt"), "profile model: expected an object, got 'gpt'"),
    (_set("schema_version", "1"), 'profile schema_version must be an integer such as 2, got "1"'),
    (
        _set("schema_version", 9),
        "profile schema version 9 is newer than this fxpipe understands (2)",
    ),
    (_drop("units"), "profile: missing the field 'units'"),
]

PLAN_CASES = [
    (_set("stages[0].units", None), "plan stages[0].units: expected a list, got null"),
    (_set("bottleneck_ms", "slow"), "plan bottleneck_ms: expected a number, got 'slow'"),
    (
        _set("prediction.step_ms.1f1b", math.nan),
        "plan prediction.step_ms['1f1b']: expected a finite number, got NaN",
    ),
    (
        _set("baselines.uniform.bottleneck_ms", -1),
        "plan baselines['uniform'].bottleneck_ms: expected a number >= 0",
    ),
    (_set("cost.link_bandwidth", 0), "plan cost: link_bandwidth must be > 0 bytes/s, got 0.0"),
    (
        _set("cost.device_speed", [1, math.inf]),
        "plan cost.device_speed[1]: expected a finite number, got Infinity",
    ),
    (_set("stages[1].memory", "big"), "plan stages[1].memory: expected an object, got 'big'"),
    (_set("microbatches", 0), "plan microbatches: expected an integer >= 1, got 0"),
    (_set("optimal", "yes"), "plan optimal: expected true or false, got 'yes'"),
    (_set("schema_version", 3), "plan schema version 3 is newer than this fxpipe understands (2)"),
]

MANIFEST_CASES = [
    (_set("stages[0].source", 123), "stages[0].source: expected a string, got 123"),
    (_set("stages", None), "stages: expected a list, got null"),
    (_set("batch_size", "8"), "batch_size: expected an integer, got '8'"),
    (
        _set("stages[1].inputs[0].shape", [-1, 8]),
        "stages[1].inputs[0].shape[0]: expected an integer >= 0, got -1",
    ),
    (_set("training", "yes"), "training: expected true or false, got 'yes'"),
    (_set("ties[0]", {"stages": [0], "keys": ["a"]}), "ties[0]: a tie needs one key per stage"),
    (_set("stages[1].index", 0), "manifest stage 1 says it is stage 0"),
    (
        _set("schema_version", 2),
        "schema version 2 is older than this fxpipe reads (versions 3 to 5); rebuild it",
    ),
    (_set("schema_version", "3"), 'schema_version must be an integer such as 5, got "3"'),
    (_drop("schema_version"), "has no schema_version; rebuild it"),
]


def _error(read: Callable[[], Any], kind: type[FxpipeError], expected: str) -> str:
    with pytest.raises(kind) as info:
        read()
    message = str(info.value)
    assert expected in message and "\n" not in message
    return message


@pytest.mark.parametrize(("change", "expected"), PROFILE_CASES)
def test_bad_profile(
    change: Callable, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copy.deepcopy(MINIMAL_PROFILE)
    change(data)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    _error(lambda: ModelProfile.from_json(path), ProfileError, expected)
    assert main(["plan", str(path), "--stages", "2", "--out", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(("change", "expected"), PLAN_CASES)
def test_bad_plan(
    change: Callable, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _plan_dict()
    change(data)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    (tmp_path / "profile.json").write_text(json.dumps(MINIMAL_PROFILE))
    _error(lambda: PartitionPlan.from_json(tmp_path / "plan.json"), PartitionError, expected)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("change", "expected"), MANIFEST_CASES)
def test_bad_manifest(change: Callable, expected: str, tmp_path: Path) -> None:
    data = json.loads(_manifest().to_json())
    change(data)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    message = _error(lambda: Manifest.from_json(tmp_path), BuildDirError, expected)
    assert str(tmp_path / "manifest.json") in message


def test_unreadable_files_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    _error(lambda: Manifest.from_json(tmp_path), BuildDirError, "is not valid JSON")
    (tmp_path / "manifest.json").write_text("[1, 2]")
    _error(lambda: Manifest.from_json(tmp_path), BuildDirError, "must be a JSON object, got list")
    (tmp_path / "profile.json").write_text("[]")
    _error(
        lambda: ModelProfile.from_json(tmp_path / "profile.json"),
        ProfileError,
        "must be a JSON object, got list",
    )
    _error(
        lambda: PartitionPlan.from_json(tmp_path / "missing.json"), PartitionError, "does not exist"
    )


def test_the_valid_files_of_the_table_load(tmp_path: Path) -> None:
    """The variants above each break a file that is valid as it stands."""
    assert ModelProfile.from_dict(copy.deepcopy(MINIMAL_PROFILE)).units[0].module_path == "embed"
    assert PartitionPlan.from_dict(_plan_dict()).num_stages == 2
    manifest = _manifest()
    manifest.to_json(tmp_path / "manifest.json")
    assert Manifest.from_json(tmp_path) == manifest
