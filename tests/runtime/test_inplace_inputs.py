"""Stages that change tensors in place train on 3 ranks (and chunks under ZBV on 2) exactly as one process
trains the model.

Each model of ``tests/inplace_models.py`` is split so that one stage changes in place a tensor it
receives (an autograd leaf there, and a buffer the runtime owns) while another stage reads that
tensor before or after the change (Note [in-place ops across stages] in ``fxpipe.tracer.frontend.mutation``).
Before the in-place analysis, ``build_model`` trained to other losses on 3 ranks (the last stage
read ``skip`` before the ReLU), and in-place calls made through functions failed on the leaf.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import inplace_models
from fxpipe.cli import main
from fxpipe.codegen.manifest import Manifest
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from reference import reference_train
from builds import original_model
from spawn import spawn

MODELS = ["build_model", "build_functional", "build_residual_stream"]
SCHEDULES = ["gpipe", "1f1b"]
STAGES, BATCH, MICROBATCHES, STEPS, LR = 3, 4, 2, 2, 0.1


def _build(factory: str, out: Path, *options: str) -> Path:
    splits = [arg for module in inplace_models.SPLITS[factory] for arg in ("--split-at", module)]
    assert (
        main(
            [
                "partition",
                f"{inplace_models.__file__}:{factory}",
                "--stages",
                str(STAGES),
                *splits,
                "--batch-size",
                str(BATCH),
                "--microbatches",
                str(MICROBATCHES),
                "--out",
                str(out),
                *options,
            ]
        )
        == 0
    )
    return out


def _train_job(
    rank: int, world: int, builds: dict[str, Path], schedules: tuple[str, ...] = tuple(SCHEDULES)
) -> dict:
    dist.init_process_group("gloo")
    out = {}
    for factory, build_dir in builds.items():
        source = load_model_file(inplace_models.__file__, model_fn=factory)
        inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
        for schedule in schedules:
            runner = PipelineRunner(
                build_dir,
                source.loss_fn,
                schedule=schedule,
                microbatches=MICROBATCHES,
                optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
                timeout_s=60,
            )
            losses = [runner.step(inputs, targets) for _ in range(STEPS)]
            out[(factory, schedule)] = (
                losses,
                {k: v.clone() for k, v in runner.state_dict().items()},
            )
    dist.destroy_process_group()
    return out


def _assert_like_one_process(
    builds: dict[str, Path], results: list[dict], stages: int, schedules: tuple[str, ...]
) -> None:
    for factory, build_dir in builds.items():
        source = load_model_file(inplace_models.__file__, model_fn=factory)
        model = original_model(build_dir, source, stages)
        want_losses, want_state = reference_train(
            model,
            source.example_inputs(BATCH),
            source.example_targets(BATCH),
            source.loss_fn,
            STEPS,
            MICROBATCHES,
            LR,
        )
        for schedule in schedules:
            for rank, res in enumerate(results):
                losses, state = res[(factory, schedule)]
                torch.testing.assert_close(
                    torch.tensor(losses),
                    torch.tensor(want_losses),
                    rtol=1e-6,
                    atol=1e-7,
                    msg=f"{factory} {schedule}: losses on rank {rank}",
                )
                for key, value in state.items():
                    torch.testing.assert_close(
                        value, want_state[key], msg=f"{factory} {schedule}: {key} on rank {rank}"
                    )


@pytest.mark.distributed
def test_stages_that_change_received_tensors_train_like_one_process(tmp_path: Path) -> None:
    builds = {factory: _build(factory, tmp_path / factory) for factory in MODELS}
    _assert_like_one_process(
        builds,
        [r.value for r in spawn(_train_job, STAGES, builds, timeout=240)],
        STAGES,
        tuple(SCHEDULES),
    )


@pytest.mark.distributed
def test_a_chunk_that_changes_what_a_chunk_of_its_own_rank_hands_it_trains_like_one_process(
    tmp_path: Path,
) -> None:
    """ZBV places chunks 1 and 2 of the residual stream on rank 1: chunk 2 receives ``iadd_2`` in memory, not
    over a wire, and changes it in place, under a split backward."""
    build = _build(
        "build_residual_stream",
        tmp_path / "zbv",
        "--stages",
        "2",
        "--schedule",
        "zbv",
        "--split-at",
        "blocks.2",
    )
    manifest = Manifest.from_json(build)
    assert [s.pipeline_rank for s in manifest.stages] == [0, 1, 1, 0] and manifest.stages[
        2
    ].mutated_inputs
    builds = {"build_residual_stream": build}
    results = [r.value for r in spawn(_train_job, 2, builds, ("zbv",), timeout=240)]
    _assert_like_one_process(builds, results, 4, ("zbv",))
