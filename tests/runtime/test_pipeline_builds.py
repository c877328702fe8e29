"""Every example model, built by tracer → partitioner → codegen, trains under both
schedules exactly as one process trains the original model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from builds import EXAMPLES, make_build, original_model
from fxpipe.codegen.manifest import Manifest
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from reference import reference_train
from spawn import spawn

MODELS = ["mlp", "gpt", "resnet", "branchy"]
SCHEDULES = ["gpipe", "1f1b"]
pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
STAGES, BATCH, MICROBATCHES, STEPS, LR = 2, 8, 4, 2, 0.1


@pytest.fixture(scope="module")
def build_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("builds")
    return {m: make_build(m, root / m, STAGES, BATCH, MICROBATCHES) for m in MODELS}


def _train_job(rank: int, world: int, build_dirs: dict[str, Path]) -> dict:
    dist.init_process_group("gloo")
    out = {}
    for name, build_dir in build_dirs.items():
        source = load_model_file(EXAMPLES / f"{name}.py")
        inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
        for schedule in SCHEDULES:
            runner = PipelineRunner(
                build_dir,
                source.loss_fn,
                schedule=schedule,
                microbatches=MICROBATCHES,
                optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
                timeout_s=60,
            )
            losses = [runner.step(inputs, targets) for _ in range(STEPS)]
            out[(name, schedule)] = (
                losses,
                {k: v.clone() for k, v in runner.stage.state_dict().items()},
            )
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_examples_train_like_one_process(build_dirs: dict[str, Path]) -> None:
    results = [r.value for r in spawn(_train_job, STAGES, build_dirs, timeout=300)]
    for name, build_dir in build_dirs.items():
        source = load_model_file(EXAMPLES / f"{name}.py")
        manifest = Manifest.from_json(build_dir)
        model = original_model(build_dir, source, manifest.num_stages)
        want_losses, want_state = reference_train(
            model,
            source.example_inputs(BATCH),
            source.example_targets(BATCH),
            source.loss_fn,
            STEPS,
            MICROBATCHES,
            LR,
        )
        assert want_losses[1] < want_losses[0]  # training does something
        for schedule in SCHEDULES:
            seen = set()
            for rank, res in enumerate(results):
                losses, state = res[(name, schedule)]
                torch.testing.assert_close(
                    torch.tensor(losses),
                    torch.tensor(want_losses),
                    msg=f"{name} {schedule}: losses on rank {rank}",
                )
                for key, value in state.items():
                    torch.testing.assert_close(
                        value, want_state[key], msg=f"{name} {schedule}: {key} on rank {rank}"
                    )
                seen.update(state)
            assert seen == set(want_state), f"{name}: the stages do not hold the whole state dict"
    gpt = Manifest.from_json(build_dirs["gpt"])
    assert gpt.ties and gpt.ties[0].stages == (0, 1)  # the tied embedding really spans both ranks


CHUNKED = ["interleaved-1f1b", "zbv"]


def _chunked_job(rank: int, world: int, build_dirs: dict[str, Path]) -> dict:
    dist.init_process_group("gloo")
    source = load_model_file(EXAMPLES / "gpt.py")
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    out = {}
    for schedule, build_dir in build_dirs.items():
        runner = PipelineRunner(
            build_dir,
            source.loss_fn,
            microbatches=MICROBATCHES,  # the build's schedule
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
            timeout_s=60,
        )
        losses = [runner.step(inputs, targets) for _ in range(STEPS)]
        out[schedule] = (
            runner.schedule.name,
            losses,
            {k: v.clone() for k, v in runner.state_dict().items()},
        )
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_chunked_builds_train_like_one_process(tmp_path: Path) -> None:
    """GPT partitioned into 2 x 2 stages (codegen writes one file per stage and each one's rank) trains
    under interleaved 1F1B and ZBV exactly as one process; ZBV keeps the tied embedding on rank 0."""
    builds = {
        s: make_build("gpt", tmp_path / s, STAGES, BATCH, MICROBATCHES, schedule=s) for s in CHUNKED
    }
    assert Manifest.from_json(builds["zbv"]).stage_ranks == (0, 1, 1, 0)
    assert Manifest.from_json(builds["interleaved-1f1b"]).stage_ranks == (0, 1, 0, 1)
    results = [r.value for r in spawn(_chunked_job, STAGES, builds, timeout=300)]
    source = load_model_file(EXAMPLES / "gpt.py")
    for schedule, build_dir in builds.items():
        model = original_model(build_dir, source, 4)
        want_losses, want_state = reference_train(
            model,
            source.example_inputs(BATCH),
            source.example_targets(BATCH),
            source.loss_fn,
            STEPS,
            MICROBATCHES,
            LR,
        )
        for rank, res in enumerate(results):
            name, losses, state = res[schedule]
            assert name == schedule
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6
            )
            for key, value in state.items():
                torch.testing.assert_close(
                    value,
                    want_state[key],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=f"{schedule}: {key} on rank {rank}",
                )
