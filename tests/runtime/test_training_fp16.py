"""fp16 autocast with one loss scale for the whole pipeline, against torch.amp.GradScaler on the whole model.

The example GPT split over 2 ranks trains under fp16 autocast with a dynamic loss scale
started high enough that the first steps overflow: the pipeline skips exactly the steps,
and holds exactly the scales, that one process with ``torch.amp.GradScaler`` on the whole
model does, and its losses agree within fp16 round-off. A gradient made inf on one stage
only skips the step on every stage and halves the scale everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from builds import EXAMPLES, original_model
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.train.optim import optimizer_factory
from fxpipe.runtime.train.training_options import TrainingOptions
from spawn import spawn
from test_training_optim import BATCH, MICROBATCHES, STAGES, _batch, gpt_build  # noqa: F401  (the fixture)

pytestmark = pytest.mark.filterwarnings(
    "ignore:fxpipe. symbolic tracing failed",
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before",
)
STEPS, LR = 8, 0.5
INIT_SCALE, GROWTH_INTERVAL = 2.0**24, 2
OPTIONS = TrainingOptions(
    optimizer="sgd"
)  # Adam would amplify round-off on zero gradients to LR steps


def _runner(build: str) -> Any:
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.pipeline.precision import PipelineScaler

    source = load_model_file(EXAMPLES / "gpt.py")
    runner = PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        timeout_s=60,
        precision="fp16",
        optimizer_factory=optimizer_factory(OPTIONS, LR),
    )
    runner.scaler = PipelineScaler(
        runner.device, runner.optimizer, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
    )
    return runner


def _job(rank: int, world: int, build: str) -> dict[str, Any]:
    with _runner(build) as runner:
        losses, scales, skipped = [], [], []
        init = {k: v.clone() for k, v in runner.stage.state_dict().items()}
        for k in range(STEPS):
            losses.append(runner.step(*_batch(k)))
            scales.append(runner.scaler.scale)
            skipped.append(runner.scaler.skipped)
        return {
            "losses": losses,
            "scales": scales,
            "skipped": skipped,
            "init": init,
            "state": {k: v.clone() for k, v in runner.stage.state_dict().items()},
        }


def _reference(model: torch.nn.Module, loss_fn: Any) -> dict[str, Any]:
    model.train()
    opt = optimizer_factory(OPTIONS, LR)(list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    losses, scales, skipped = [], [], []
    for k in range(STEPS):
        opt.zero_grad()
        x, y = _batch(k)
        total = 0.0
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(xm), ym)
            scaler.scale(loss / MICROBATCHES).backward()
            total += loss.item()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        losses.append(total / MICROBATCHES)
        scales.append(scaler.get_scale())
        skipped.append(scaler.get_scale() < before)
    return {"losses": losses, "scales": scales, "skipped": skipped, "state": model.state_dict()}


@pytest.mark.distributed
def test_fp16_skips_and_scales_as_grad_scaler_on_one_process(gpt_build: Path) -> None:
    source = load_model_file(EXAMPLES / "gpt.py")
    want = _reference(original_model(gpt_build, source, STAGES), source.loss_fn)
    assert any(want["skipped"]) and not all(
        want["skipped"]
    )  # the scale overflows at first, then settles
    assert len(set(want["scales"])) > 2  # it backs off and grows
    results = [r.value for r in spawn(_job, STAGES, str(gpt_build), timeout=180)]
    for r in results:
        assert r["skipped"] == want["skipped"]
        assert r["scales"] == want["scales"]
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=5e-3, atol=0
        )
    state = {**results[0]["state"], **results[1]["state"]}
    init = {**results[0]["init"], **results[1]["init"]}
    assert (
        max(float((state[k] - init[k]).abs().max()) for k in state) > 0.05
    )  # training moved the weights
    for key, value in state.items():
        assert value.dtype == torch.float32  # master weights stay fp32
        torch.testing.assert_close(value, want["state"][key], msg=key, rtol=0, atol=5e-4)


def _overflow_job(rank: int, world: int, build: str, poisoned_step: int) -> dict[str, Any]:
    with _runner(build) as runner:
        runner.scaler = type(runner.scaler)(
            runner.device, runner.optimizer
        )  # 2**16: no natural overflow
        step = {"k": -1}
        if rank == world - 1:  # only the last stage's gradient turns inf
            weight = next(p for p in runner.stage.parameters() if p.requires_grad)
            weight.register_hook(lambda g: g * float("inf") if step["k"] == poisoned_step else g)
        rows = []
        for k in range(4):
            step["k"] = k
            before = {n: v.clone() for n, v in runner.stage.state_dict().items()}
            runner.step(*_batch(k))
            after = runner.stage.state_dict()
            rows.append(
                {
                    "scale": runner.scaler.scale,
                    "skipped": runner.scaler.skipped,
                    "moved": any(not torch.equal(v, after[n]) for n, v in before.items()),
                }
            )
        return {"rows": rows}


@pytest.mark.distributed
def test_an_inf_gradient_on_one_stage_skips_the_step_on_every_stage_and_halves_the_scale(
    gpt_build: Path,
) -> None:
    poisoned = 2
    results = [
        r.value["rows"] for r in spawn(_overflow_job, STAGES, str(gpt_build), poisoned, timeout=180)
    ]
    for rows in results:  # stage 0's own gradients were finite, yet it skipped too
        assert [r["skipped"] for r in rows] == [k == poisoned for k in range(4)]
        assert [r["moved"] for r in rows] == [k != poisoned for k in range(4)]
        assert [r["scale"] for r in rows] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]


_THREADS_AFTER_CLOSE = """
import gc, glob, sys
import fxpipe.runtime.pipeline.runner  # what a rank imports before it joins the process group
import torch, torch.distributed as dist
from fxpipe.runtime.pipeline.precision import PipelineScaler

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
param = torch.nn.Parameter(torch.ones(2))
scaler = PipelineScaler(torch.device("cpu"), torch.optim.SGD([param], lr=0.1))
(param.sum() * scaler.scale).backward()
scaler.step()
dist.destroy_process_group()
del scaler, param
gc.collect()
print(sorted(open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a Linux process's threads")
def test_no_gloo_thread_outlives_the_group_under_fp16(tmp_path: Path) -> None:
    """Note [scaler import time]: a default group kept alive by torch's scaler module ran
    its gloo threads into the rank's exit, where one aborted (SIGABRT, seen in CI)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _THREADS_AFTER_CLOSE, f"file://{tmp_path / 'store'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    threads = done.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
