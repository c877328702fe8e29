"""Builds of models that change tensors in place: the manifest lists each stage's changed inputs, the
chained stages get copies as the runtime does, and the check refuses a split that reads a stale copy.

Note [in-place ops across stages] in ``fxpipe.tracer.frontend.mutation``; the models are ``tests/inplace_models.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import fxpipe.tracer.api
import inplace_models
from fxpipe.cli import main
from fxpipe.codegen.manifest import Manifest
from fxpipe.codegen.check.verify import verify_build
from fxpipe.errors import BuildDirError

MODEL_FILE = Path(inplace_models.__file__)


def _partition(factory: str, out: Path, *extra: str) -> int:
    splits = [arg for module in inplace_models.SPLITS[factory] for arg in ("--split-at", module)]
    return main(
        [
            "partition",
            f"{MODEL_FILE}:{factory}",
            "--stages",
            "3",
            *splits,
            "--batch-size",
            "4",
            "--microbatches",
            "2",
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "factory, changed",
    [
        ("build_model", [(), ("a_out",), ()]),
        ("build_functional", [(), ("a_out",), ()]),
        ("build_view_write", [(), (), ()]),
        ("build_eval_only", [(), (), ()]),
        ("build_residual_stream", [(), ("iadd",), ("iadd_2",)]),
    ],
)
def test_each_stage_lists_the_inputs_it_changes_and_the_build_verifies(
    factory: str, changed: list[tuple[str, ...]], tmp_path: Path
) -> None:
    assert _partition(factory, tmp_path) == 0
    manifest = Manifest.from_json(tmp_path)
    assert [s.mutated_inputs for s in manifest.stages] == changed
    report = verify_build(tmp_path)
    assert report.ok, report.summary()
    assert all(t.max_abs == 0 for mode in report.modes for t in (*mode.outputs, *mode.grads))


def test_the_check_refuses_stages_that_read_a_tensor_before_another_stage_changed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the in-place analysis, stage 2 reads ``skip`` as stage 0 sent it, before stage 1's ReLU:
    the chained stages pass copies between stages as the runtime does, so the check sees it."""
    monkeypatch.setattr(fxpipe.tracer.api, "isolate_mutations", lambda gm, values, found: ([], {}))
    assert _partition("build_model", tmp_path) != 0
    err = capsys.readouterr().err
    assert (
        "the emitted stages differ from the model in train mode" in err
        and "the build was not written" in err
    )
    assert not (tmp_path / "manifest.json").exists()


def test_augmented_assignment_is_emitted_as_operator_calls(tmp_path: Path) -> None:
    assert _partition("build_residual_stream", tmp_path) == 0
    source = (tmp_path / "stage_1.py").read_text()
    assert (
        "import operator\n" in source and "iadd = operator.iadd(iadd, blocks_1)" in source
    )  # `x += f(x)`


def test_the_manifest_refuses_a_changed_input_the_stage_does_not_have(tmp_path: Path) -> None:
    assert _partition("build_model", tmp_path) == 0
    stage = Manifest.from_json(tmp_path).stages[1]
    with pytest.raises(
        BuildDirError, match=r"stage 1: mutated_inputs \['b_out'\] are not inputs of the stage"
    ):
        dataclasses.replace(stage, mutated_inputs=("b_out",))
