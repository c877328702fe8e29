"""Optimizers, learning-rate schedules, clipping across stages and eval, each against one process on the whole model.

The example GPT (tied input/output embeddings, split over 2 ranks so the tie spans them)
trains with AdamW + warm-up + cosine + global-norm clipping; its losses, gradient norms,
learning rates and every parameter equal one process running torch's own AdamW,
LambdaLR and ``torch.nn.utils.clip_grad_norm_`` on the whole model. ``eval_step``
equals the whole model's loss in eval mode under ``no_grad`` and changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from builds import EXAMPLES, make_build, original_model
from fxpipe.codegen.manifest import Manifest
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.train.optim import lr_factor, optimizer_factory, scheduler_factory
from fxpipe.runtime.train.training_options import TrainingOptions
from spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
STAGES, BATCH, MICROBATCHES, STEPS, LR, MAX_NORM = 2, 4, 2, 4, 3e-3, 0.5
WIDTH = 32  # examples/gpt.py's
OPTIONS = TrainingOptions(
    optimizer="adamw", weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=2, lr_schedule="cosine"
)


@pytest.fixture(scope="module")
def gpt_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_build("gpt", tmp_path_factory.mktemp("gpt") / "build", STAGES, BATCH, MICROBATCHES)


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    return torch.randint(0, 64, (BATCH, 16), generator=g), torch.randint(
        0, 64, (BATCH, 16), generator=g
    )


def _job(rank: int, world: int, build: str) -> dict[str, Any]:
    from fxpipe.runtime import PipelineRunner

    source = load_model_file(EXAMPLES / "gpt.py")
    with PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=optimizer_factory(OPTIONS, LR),
        scheduler_factory=scheduler_factory(OPTIONS, STEPS),
        max_grad_norm=MAX_NORM,
    ) as runner:
        losses, norms, lrs = [], [], []
        for k in range(STEPS):
            lrs.append(runner.optimizer.param_groups[0]["lr"])
            losses.append(runner.step(*_batch(k)))
            norms.append(runner.last_grad_norm)
        before = {k: v.clone() for k, v in runner.stage.state_dict().items()}
        grads = [None if p.grad is None else p.grad.clone() for p in runner.stage.parameters()]
        val = runner.eval_step(*_batch(99))
        unchanged = (
            all(torch.equal(v, runner.stage.state_dict()[k]) for k, v in before.items())
            and all(
                (g is None and p.grad is None) or torch.equal(g, p.grad)
                for g, p in zip(grads, runner.stage.parameters())
            )
            and runner.stage.training
        )
        return {
            "losses": losses,
            "norms": norms,
            "lrs": lrs,
            "eval": val,
            "unchanged": unchanged,
            "state": before,
        }


def _reference(model: torch.nn.Module, loss_fn: Any) -> dict[str, Any]:
    model.train()
    opt = optimizer_factory(OPTIONS, LR)(list(model.parameters()))
    sched = scheduler_factory(OPTIONS, STEPS)(opt)
    losses, norms, lrs = [], [], []
    for k in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        x, y = _batch(k)
        step = 0.0
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            loss = loss_fn(model(xm), ym)
            (loss / MICROBATCHES).backward()
            step += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        sched.step()
        losses.append(step / MICROBATCHES)
    model.eval()
    with torch.no_grad():
        x, y = _batch(99)
        val = sum(
            loss_fn(model(xm), ym).item()
            for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))
        )
    return {
        "losses": losses,
        "norms": norms,
        "lrs": lrs,
        "eval": val / MICROBATCHES,
        "state": model.state_dict(),
    }


@pytest.mark.distributed
def test_adamw_cosine_warmup_clipping_and_eval_equal_one_process_with_tied_weights(
    gpt_build: Path,
) -> None:
    manifest = Manifest.from_json(gpt_build)
    assert any(
        len({manifest.stage_ranks[s] for s in t.stages}) == 2 for t in manifest.ties
    )  # the tie spans ranks
    source = load_model_file(EXAMPLES / "gpt.py")
    want = _reference(original_model(gpt_build, source, STAGES), source.loss_fn)
    assert max(want["norms"]) > MAX_NORM  # clipping bites
    results = [r.value for r in spawn(_job, STAGES, str(gpt_build), timeout=180)]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]))
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(want["norms"]))
        assert r["lrs"] == pytest.approx(want["lrs"], rel=0, abs=0)
        assert r["eval"] == pytest.approx(want["eval"], rel=1e-5)
        assert r["unchanged"]
    state = {**results[0]["state"], **results[1]["state"]}
    assert set(state) <= set(want["state"])
    for key, value in state.items():
        expected = want["state"][key]
        if key.endswith("attn.qkv.bias"):
            # the key bias has an exactly zero gradient (softmax ignores a shift per query), so Adam
            # normalises round-off there and both runs move it by noise of up to ~LR per step
            keys = slice(WIDTH, 2 * WIDTH)
            torch.testing.assert_close(
                value[keys], expected[keys], rtol=0, atol=LR * STEPS, msg=key
            )
            value, expected = (
                torch.cat([value[:WIDTH], value[2 * WIDTH :]]),
                torch.cat([expected[:WIDTH], expected[2 * WIDTH :]]),
            )
        torch.testing.assert_close(value, expected, msg=key, rtol=1e-5, atol=1e-6)


def test_lr_factor_warms_up_then_follows_the_schedule() -> None:
    assert [lr_factor(s, warmup_steps=0, total_steps=4, schedule="constant") for s in range(4)] == [
        1.0
    ] * 4
    cosine = [lr_factor(s, warmup_steps=1, total_steps=5, schedule="cosine") for s in range(5)]
    assert cosine[0] == 1.0 and cosine[1] == 1.0 and cosine[3] == pytest.approx(0.5)
    assert (
        lr_factor(10, warmup_steps=1, total_steps=5, schedule="linear") == 0.0
    )  # past the end: stays at 0


def test_training_options_refuse_bad_values_with_the_flag_named() -> None:
    from fxpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="--optimizer must be one of"):
        TrainingOptions(optimizer="lamb")
    with pytest.raises(ConfigError, match="--betas must be two numbers"):
        TrainingOptions(betas=(0.9, 1.5))
    with pytest.raises(ConfigError, match="--resume needs --checkpoint-dir"):
        TrainingOptions(resume=True)
    with pytest.raises(ConfigError, match="--clip-grad-norm must be a number > 0"):
        TrainingOptions(clip_grad_norm=0.0)


def test_training_flags_are_one_table_for_the_cli_and_the_worker() -> None:
    from fxpipe.cli import build_parser
    from fxpipe.runtime.train.run_options import RunOptions, run_options_from_args
    from fxpipe.runtime.launch.worker import parse_args as worker_args

    flags = [
        "--optimizer",
        "adamw",
        "--lr",
        "3e-4",
        "--weight-decay",
        "0.1",
        "--betas",
        "0.9,0.95",
        "--warmup-steps",
        "5",
        "--lr-schedule",
        "cosine",
        "--clip-grad-norm",
        "1.0",
        "--data",
        "d.py:batches",
        "--eval-every",
        "10",
        "--eval-steps",
        "2",
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "5",
        "--resume",
        "--log-every",
        "20",
    ]
    cli = run_options_from_args(build_parser().parse_args(["run", "build", *flags]))
    assert cli == run_options_from_args(worker_args(["build", *flags]))
    assert cli.training == TrainingOptions(
        optimizer="adamw",
        weight_decay=0.1,
        betas=(0.9, 0.95),
        warmup_steps=5,
        lr_schedule="cosine",
        clip_grad_norm=1.0,
        data="d.py:batches",
        eval_every=10,
        eval_steps=2,
        checkpoint_dir="ck",
        checkpoint_every=5,
        resume=True,
        log_every=20,
    )
    assert RunOptions.from_json(cli.to_json()) == cli
    assert RunOptions().training == TrainingOptions()


def test_checkpoints_take_every_sharding_level() -> None:
    """ZeRO's optimizer shards are saved too now (Note [checkpoints keyed by the model];
    tests/runtime/test_dcp_checkpoint.py resumes them)."""
    from fxpipe.runtime.dataparallel import DataParallelOptions
    from fxpipe.runtime.train.run_options import RunOptions

    RunOptions(
        dp=2,
        data_parallel=DataParallelOptions(shard="optimizer"),
        training=TrainingOptions(checkpoint_dir="ck"),
    )
    RunOptions(
        dp=2,
        data_parallel=DataParallelOptions(shard="full"),
        training=TrainingOptions(checkpoint_dir="ck"),
    )


def _dp_job(rank: int, world: int, build: str) -> dict[str, Any]:
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.dataparallel import DataParallelOptions

    source = load_model_file(EXAMPLES / "gpt.py")
    with PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.5),
        max_grad_norm=MAX_NORM,
        data_parallel=DataParallelOptions(),
    ) as runner:
        rows = slice(runner.replica * BATCH, (runner.replica + 1) * BATCH)
        norms = []
        for k in range(2):
            x, y = _batch(k), _batch(k + 50)
            runner.step(torch.cat([x[0], y[0]])[rows], torch.cat([x[1], y[1]])[rows])
            norms.append(runner.last_grad_norm)
        return {
            "norms": norms,
            "replica": runner.replica,
            "state": {k: v.clone() for k, v in runner.stage.state_dict().items()},
        }


@pytest.mark.distributed
@pytest.mark.slow
def test_clipping_with_data_parallel_replicas_equals_one_process_on_the_global_batch(
    gpt_build: Path,
) -> None:
    source = load_model_file(EXAMPLES / "gpt.py")
    model = original_model(gpt_build, source, STAGES).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    want_norms = []
    for k in range(2):
        x, y = _batch(k), _batch(k + 50)
        inputs, targets = torch.cat([x[0], y[0]]), torch.cat([x[1], y[1]])
        opt.zero_grad()
        chunks = 2 * MICROBATCHES
        for xm, ym in zip(inputs.chunk(chunks), targets.chunk(chunks)):
            (source.loss_fn(model(xm), ym) / chunks).backward()
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    assert min(want_norms) > MAX_NORM
    results = [r.value for r in spawn(_dp_job, 2 * STAGES, str(gpt_build), timeout=240)]
    want = model.state_dict()
    for r in results:  # every rank of every replica: the same global norm, the same weights
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(want_norms))
        for key, value in r["state"].items():
            torch.testing.assert_close(value, want[key], msg=key, rtol=1e-5, atol=1e-6)


def _bf16_job(rank: int, world: int, build: str) -> dict[str, Any]:
    from fxpipe.runtime import PipelineRunner

    source = load_model_file(EXAMPLES / "gpt.py")
    with PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        timeout_s=60,
        precision="bf16",
        optimizer_factory=optimizer_factory(OPTIONS, LR),
        scheduler_factory=scheduler_factory(OPTIONS, STEPS),
        max_grad_norm=MAX_NORM,
    ) as runner:
        wire: set[torch.dtype] = (
            set()
        )  # the dtypes of every message sent or received between the stages
        post = runner._p2p.post
        runner._p2p.post = lambda sends, recvs: (
            wire.update(m.tensor.dtype for m in [*sends, *recvs]),
            post(sends, recvs),
        )[1]
        losses = [runner.step(*_batch(k)) for k in range(STEPS)]
        return {
            "losses": losses,
            "norms": runner.last_grad_norm,
            "eval": runner.eval_step(*_batch(99)),
            "wire": wire,
            "state": {k: v.clone() for k, v in runner.stage.state_dict().items()},
        }


@pytest.mark.distributed
def test_bf16_autocast_per_stage_equals_one_process_under_autocast(gpt_build: Path) -> None:
    source = load_model_file(EXAMPLES / "gpt.py")
    model = original_model(gpt_build, source, STAGES).train()
    opt = optimizer_factory(OPTIONS, LR)(list(model.parameters()))
    sched = scheduler_factory(OPTIONS, STEPS)(opt)
    want = []
    for k in range(STEPS):
        opt.zero_grad()
        x, y = _batch(k)
        total = 0.0
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = source.loss_fn(model(xm), ym)
            (loss / MICROBATCHES).backward()
            total += loss.item()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        sched.step()
        want.append(total / MICROBATCHES)
    fp32 = _reference(original_model(gpt_build, source, STAGES), source.loss_fn)["losses"]
    assert want != fp32  # autocast changes the numbers
    results = [r.value for r in spawn(_bf16_job, STAGES, str(gpt_build), timeout=180)]
    for r in results:
        assert r["wire"] == {
            torch.bfloat16
        }  # activations and their gradients cross in bf16: half the bytes
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want), rtol=2e-3, atol=0)
        assert r["norms"] == pytest.approx(norm, rel=2e-2)
    state = {**results[0]["state"], **results[1]["state"]}
    for key, value in state.items():
        assert value.dtype == torch.float32  # master weights stay fp32
        # Adam normalises round-off where a gradient is near zero into steps of up to LR (see the fp32 test), and
        # the activations crossing in bf16 add round-off (the fp16 test checks the weights tightly under SGD): a
        # few elements may move apart by Adam's bound (a step of at most ~LR each way, every step), while the
        # mean and 99% of the elements stay within bf16 noise
        if key.endswith(
            "attn.qkv.bias"
        ):  # the key bias's gradient is exactly zero: Adam moves it by noise alone
            continue
        diff = (value - model.state_dict()[key]).abs().flatten()
        p99 = float(diff.kthvalue(max(1, int(0.99 * diff.numel()))).values)
        assert float(diff.mean()) < 3e-4 and p99 < LR and float(diff.max()) < 2 * LR * STEPS, key
