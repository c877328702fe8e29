"""manifest.json: typed build facts (microbatches, training, torch version), round trip, old versions refused."""

from __future__ import annotations

import json

import pytest
import torch
from codegen_support import example_build  # noqa: F401 (fixture)

from fxpipe.codegen import Manifest, load_stage
from fxpipe.codegen.manifest import MANIFEST_SCHEMA_VERSION
from fxpipe.errors import BuildDirError


def test_build_records_typed_fields_and_round_trips(example_build) -> None:
    manifest, _, out = example_build("mlp", 2, microbatch=2, microbatches=3)
    assert (manifest.microbatches, manifest.training, manifest.torch_version) == (
        3,
        True,
        torch.__version__,
    )
    data = json.loads((out / "manifest.json").read_text())
    assert data["schema_version"] == MANIFEST_SCHEMA_VERSION == 5 and "extra" not in data
    assert (data["microbatches"], data["training"], data["torch_version"]) == (
        3,
        True,
        torch.__version__,
    )
    assert Manifest.from_json(out) == manifest


def test_microbatches_default_to_the_batch_over_the_microbatch(example_build) -> None:
    manifest, _, _ = example_build("mlp", 2, microbatch=2, microbatches=2)
    bare = Manifest(**{**manifest.__dict__, "microbatches": 0, "batch_size": 8})
    assert bare.microbatches == 4


def test_a_version_1_manifest_is_refused_with_the_remedy(example_build) -> None:
    manifest, _, out = example_build("mlp", 2)
    data = json.loads(manifest.to_json())
    for key in ("microbatches", "training", "torch_version"):
        data.pop(key)
    data.update(
        schema_version=1, extra={"microbatches": 2, "training": True, "torch": torch.__version__}
    )
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        BuildDirError,
        match=r"schema version 1 is older than this fxpipe reads \(versions 3 to 5\); "
        r"rebuild it with this fxpipe's `fxpipe partition`",
    ):
        Manifest.from_json(out)


def test_a_version_3_manifest_is_read_and_has_no_shared_classes(example_build) -> None:
    """Version 3 builds wrote every class into each stage file: nothing else to check or import."""
    manifest, _, out = example_build("mlp", 2)
    data = json.loads(manifest.to_json())
    for stage in data["stages"]:
        stage.pop("imports_shared")
    for key in ("shared_source", "shared_sha256"):
        data.pop(key)
    data.update(schema_version=3)
    (out / "manifest.json").write_text(json.dumps(data))
    old = Manifest.from_json(out)
    assert (
        old.schema_version == 3
        and old.shared_source == ""
        and not any(s.imports_shared for s in old.stages)
    )
    assert load_stage(out, 1) is not None


def test_a_newer_manifest_is_refused_with_upgrade(example_build) -> None:
    manifest, _, out = example_build("mlp", 2)
    data = json.loads(manifest.to_json())
    data.update(schema_version=MANIFEST_SCHEMA_VERSION + 1)
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        BuildDirError, match=r"newer than this fxpipe understands \(5\); upgrade fxpipe"
    ):
        Manifest.from_json(out)


def test_a_version_2_manifest_is_refused_since_its_stages_may_change_shared_inputs(
    example_build,
) -> None:
    """Version 2 builds do not list the inputs a stage changes in place (Note [in-place ops across stages]);
    run as they are, such a stage changes a buffer another stage reads: rebuild."""
    manifest, _, out = example_build("mlp", 2)
    data = json.loads(manifest.to_json())
    for stage in data["stages"]:
        stage.pop("mutated_inputs")
    data.update(schema_version=2)
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        BuildDirError,
        match=r"schema version 2 is older than this fxpipe reads \(versions 3 to 5\); "
        r"rebuild it",
    ):
        Manifest.from_json(out)
