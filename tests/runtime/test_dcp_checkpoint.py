"""Checkpoints keyed by the original model (Note [checkpoints keyed by the model]): saved in one
layout, resumed in another, on the trajectory of one process.

Each test trains 4 steps at layout A, saves, resumes at layout B for 4 more, and compares the 8
losses and the final parameters with 8 steps of the original model in one process (fp32, AdamW
with weight decay, warm-up and a cosine schedule, the same global batch every step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from builds import EXAMPLES, make_build, original_model
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.train.optim import optimizer_factory, scheduler_factory
from fxpipe.runtime.train.training_options import TrainingOptions
from spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
BATCH, MICROBATCHES, HALF, LR = 8, 2, 4, 1e-2
CLOSE = {"rtol": 1e-5, "atol": 1e-6}
COMPILED_CLOSE = {"rtol": 1e-4, "atol": 1e-5}  # compiled kernels round otherwise
OPTIONS = TrainingOptions(
    optimizer="adamw", weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=2, lr_schedule="cosine"
)


def _batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + k)
    return torch.randn(BATCH, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _job(
    rank: int,
    world: int,
    build: str,
    ckdir: str,
    resume: bool,
    schedule: str | None,
    shard: str,
    compile: bool = False,
) -> dict[str, Any]:
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.dataparallel import DataParallelOptions
    from fxpipe.runtime.dataparallel.state_dict import gather_if_sharded
    from fxpipe.runtime.train.commit import read_record
    from fxpipe.runtime.train.dcp_checkpoint import (
        check_dcp_keys,
        load_dcp_checkpoint,
        save_dcp_checkpoint,
    )
    from fxpipe.runtime.train.loop import _mean_over_replicas

    source = load_model_file(EXAMPLES / "mlp.py")
    with PipelineRunner(
        build,
        source.loss_fn,
        schedule=schedule,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=optimizer_factory(OPTIONS, LR),
        scheduler_factory=scheduler_factory(OPTIONS, 2 * HALF),
        data_parallel=DataParallelOptions(shard=shard),
        compile=compile,
    ) as runner:
        first, history = 0, {"losses": []}
        if resume:
            record = read_record(Path(ckdir) / "checkpoint.json")
            assert record is not None
            check_dcp_keys(runner, ckdir, record)
            got = load_dcp_checkpoint(runner, ckdir, record)
            first, history = got["step"], got["history"]
            assert got["samples"] == first * BATCH
        replicas, r = runner.layout.replicas, runner.replica
        per = BATCH // replicas
        for k in range(first, first + HALF):
            x, y = _batch(k)
            loss = runner.step(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per])
            history["losses"].append(_mean_over_replicas(loss, runner))
        if not resume:
            save_dcp_checkpoint(ckdir, runner, first + HALF, (first + HALF) * BATCH, history, {})
        return {"losses": history["losses"], "state": gather_if_sharded(runner.state_dict())}


def _reference(build: Path, stages: int) -> dict[str, Any]:
    source = load_model_file(EXAMPLES / "mlp.py")
    model = original_model(build, source, stages).train()
    opt = optimizer_factory(OPTIONS, LR)(list(model.parameters()))
    sched = scheduler_factory(OPTIONS, 2 * HALF)(opt)
    losses = []
    for k in range(2 * HALF):
        opt.zero_grad()
        x, y = _batch(k)
        loss = source.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def _check(results: list[Any], want: dict[str, Any], close: dict[str, float] = CLOSE) -> None:
    state: dict[str, torch.Tensor] = {}
    for r in results:
        torch.testing.assert_close(
            torch.tensor(r.value["losses"]), torch.tensor(want["losses"]), **close
        )
        state.update(r.value["state"])
    assert set(state) == set(want["state"])
    for key, value in state.items():
        torch.testing.assert_close(value, want["state"][key], **close, msg=key)


def _pair(
    tmp: Path,
    a: tuple[int, int, str, str],
    b: tuple[int, int, str, str],
    compile: bool = False,
) -> None:
    """Train layout ``a`` = (stages, replicas, schedule, shard) 4 steps, resume at ``b`` for 4
    (``compile``: both runs' stages compiled)."""
    close = COMPILED_CLOSE if compile else CLOSE
    (sa, ra, scha, sha), (sb, rb, schb, shb) = a, b
    build_a = make_build("mlp", tmp / "a", sa, BATCH // ra, MICROBATCHES, scha)
    build_b = make_build("mlp", tmp / "b", sb, BATCH // rb, MICROBATCHES, schb)
    from fxpipe.codegen.manifest import Manifest

    want = _reference(build_a, Manifest.from_json(build_a).num_stages)
    ranks_a = Manifest.from_json(build_a).num_ranks * ra
    ranks_b = Manifest.from_json(build_b).num_ranks * rb
    ck = str(tmp / "ck")
    first = spawn(_job, ranks_a, str(build_a), ck, False, scha, sha, compile, timeout=600)
    torch.testing.assert_close(
        torch.tensor(first[0].value["losses"]), torch.tensor(want["losses"][:HALF]), **close
    )
    _check(
        spawn(_job, ranks_b, str(build_b), ck, True, schb, shb, compile, timeout=600), want, close
    )


@pytest.mark.distributed
def test_two_stages_1f1b_resume_on_one_rank(tmp_path: Path) -> None:
    _pair(tmp_path, (2, 1, "1f1b", "none"), (1, 1, "1f1b", "none"))


@pytest.mark.distributed
def test_one_rank_resumes_as_two_ranks_of_zbv_chunks(tmp_path: Path) -> None:
    _pair(tmp_path, (1, 1, "1f1b", "none"), (2, 1, "zbv", "none"))


@pytest.mark.distributed
def test_zero_sharded_optimizer_2x2_resumes_on_one_rank(tmp_path: Path) -> None:
    _pair(tmp_path, (2, 2, "1f1b", "optimizer"), (1, 1, "1f1b", "none"))


@pytest.mark.distributed
def test_four_stages_resume_as_two_by_two_fully_sharded(tmp_path: Path) -> None:
    _pair(tmp_path, (4, 1, "1f1b", "none"), (2, 2, "1f1b", "full"))


@pytest.mark.distributed
def test_compiled_zb_h1_stages_resume_compiled_as_zbv_chunks(tmp_path: Path) -> None:
    """A compiled run's checkpoint (its stages' forwards replaced by compiled ones, their names
    unchanged) resumes on another layout, compiled again: 2 stages of zb-h1 as 4 chunks of zbv."""
    _pair(tmp_path, (2, 1, "zb-h1", "none"), (2, 1, "zbv", "none"), compile=True)


@pytest.mark.distributed
def test_two_stages_1f1b_resume_as_four_ranks_of_zbv(tmp_path: Path) -> None:
    _pair(tmp_path, (2, 1, "1f1b", "none"), (4, 1, "zbv", "none"))


# -- a transformers model: keyword call with labels=, its own loss, tied embeddings ---------------


HF_LR = 3e-3


def _hf_job(rank: int, world: int, build: str, ckdir: str, resume: bool) -> dict[str, Any]:
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.train.commit import read_record
    from fxpipe.runtime.train.dcp_checkpoint import (
        check_dcp_keys,
        load_dcp_checkpoint,
        save_dcp_checkpoint,
    )

    source = load_model_file(EXAMPLES / "hf_lm.py")
    batch = source.example_call(BATCH)
    with PipelineRunner(
        build,
        None,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=optimizer_factory(OPTIONS, HF_LR),
        scheduler_factory=scheduler_factory(OPTIONS, 2 * HALF),
    ) as runner:
        first, losses = 0, []
        if resume:
            record = read_record(Path(ckdir) / "checkpoint.json")
            assert record is not None
            check_dcp_keys(runner, ckdir, record)
            got = load_dcp_checkpoint(runner, ckdir, record)
            first, losses = got["step"], got["history"]["losses"]
        for _ in range(HALF):
            losses.append(runner.step(batch))
        if not resume:
            save_dcp_checkpoint(ckdir, runner, first + HALF, 0, {"losses": losses}, {})
        return {"losses": losses, "state": dict(runner.state_dict())}


@pytest.mark.distributed
def test_gpt2_with_labels_and_tied_embeddings_resumes_on_one_rank(tmp_path: Path) -> None:
    from fxpipe.runtime.train.dcp_checkpoint import read_model_state

    source = load_model_file(EXAMPLES / "hf_lm.py")
    model = source.build_model().train()
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = optimizer_factory(OPTIONS, HF_LR)(list(model.parameters()))
    sched = scheduler_factory(OPTIONS, 2 * HALF)(opt)
    call = source.example_call(BATCH).kwargs
    chunks = [{k: v.chunk(MICROBATCHES)[m] for k, v in call.items()} for m in range(MICROBATCHES)]
    want = []
    for _ in range(2 * HALF):
        opt.zero_grad()
        step = [model(**c).loss for c in chunks]
        (sum(step) / MICROBATCHES).backward()
        opt.step()
        sched.step()
        want.append(sum(float(v.detach()) for v in step) / MICROBATCHES)

    a = make_build("hf_lm", tmp_path / "a", 2, BATCH, MICROBATCHES)
    b = make_build("hf_lm", tmp_path / "b", 1, BATCH, MICROBATCHES)
    ck = str(tmp_path / "ck")
    spawn(_hf_job, 2, str(a), ck, False, timeout=240)
    stored = read_model_state(ck)  # the tie: stored once, exported under both names
    assert stored["lm_head.weight"] is stored["transformer.wte.weight"]
    (result,) = spawn(_hf_job, 1, str(b), ck, True, timeout=240)
    torch.testing.assert_close(
        torch.tensor(result.value["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-6
    )
    final = model.state_dict()
    assert set(result.value["state"]) <= set(final)
    for key, value in result.value["state"].items():
        expected = final[key]
        if key.endswith("c_attn.bias"):
            # the key bias has an exactly zero gradient (softmax ignores a shift per query): Adam
            # normalises round-off there (see test_training_optim)
            keys = slice(16, 32)
            torch.testing.assert_close(value[keys], expected[keys], rtol=0, atol=HF_LR * 2 * HALF)
            value = torch.cat([value[:16], value[32:]])
            expected = torch.cat([expected[:16], expected[32:]])
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=key)


# -- a per-rank checkpoint of an older fxpipe, converted once (Note [converting per-rank checkpoints])


def _old_format_job(rank: int, world: int, build: str, ckdir: str, schedule: str) -> list[float]:
    """4 steps on 2 ranks, then the per-rank checkpoint earlier versions wrote."""
    from fxpipe.codegen.load import read_manifest
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.train.checkpoint import save_training_checkpoint, training_state
    from fxpipe.runtime.train.resume import build_identity, checkpoint_meta
    from fxpipe.runtime.train.run_record import build_sha256

    source = load_model_file(EXAMPLES / "mlp.py")
    with PipelineRunner(
        build,
        source.loss_fn,
        schedule=schedule,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=optimizer_factory(OPTIONS, LR),
        scheduler_factory=scheduler_factory(OPTIONS, 2 * HALF),
    ) as runner:
        history: dict[str, Any] = {"losses": []}
        for k in range(HALF):
            history["losses"].append(runner.step(*_batch(k)))
        identity = build_identity(read_manifest(build), build_sha256(build))
        settings = {"batch_size": BATCH, "microbatches": MICROBATCHES, "optimizer": "adamw"}
        save_training_checkpoint(
            ckdir,
            runner.rank,
            runner.world_size,
            training_state(runner, HALF, HALF, history),
            checkpoint_meta(HALF, settings, identity),
        )
        return list(history["losses"])


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_converted_per_rank_checkpoint_resumes_on_another_layout(
    tmp_path: Path, schedule: str
) -> None:
    """``fxpipe checkpoint convert OLD NEW --build A``: the per-rank files of 2 ranks (one stage
    each, or two ZBV chunks each) become a model-keyed checkpoint that one rank resumes on one
    process's trajectory."""
    from fxpipe.cli import main
    from fxpipe.codegen.manifest import Manifest

    build_a = make_build("mlp", tmp_path / "a", 2, BATCH, MICROBATCHES, schedule)
    build_b = make_build("mlp", tmp_path / "b", 1, BATCH, MICROBATCHES)
    want = _reference(build_a, Manifest.from_json(build_a).num_stages)
    old, new = tmp_path / "old", tmp_path / "new"
    spawn(_old_format_job, 2, str(build_a), str(old), schedule, timeout=240)
    assert sorted(p.name for p in old.glob("rank_*.pt")) == ["rank_0.pt", "rank_1.pt"]
    convert = ["checkpoint", "convert", str(old), str(new)]
    assert main([*convert, "--build", str(build_b)]) != 0  # not the build that wrote it
    assert not new.exists() or not any(new.iterdir())
    assert main([*convert, "--build", str(build_a)]) == 0
    assert (old / "rank_0.pt").is_file()  # the old checkpoint is left as it is
    _check(spawn(_job, 1, str(build_b), str(new), True, "1f1b", "none", timeout=240), want)


# -- the RNG streams carry over by stage (Note [RNG streams by stage]) ------------------------------


DROPOUT = Path(__file__).with_name("dropout_mlp.py")


def _dropout_job(
    rank: int, world: int, build: str, ckdir: str, first: int, steps: int, schedule: str
) -> dict[str, Any]:
    """``steps`` steps of the dropout MLP from step ``first`` (resumed from ``ckdir`` when > 0;
    saved into it when 0), each rank seeded apart as a job's ranks are."""
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.train.commit import read_record
    from fxpipe.runtime.train.dcp_checkpoint import load_dcp_checkpoint, save_dcp_checkpoint

    source = load_model_file(DROPOUT)
    torch.manual_seed(1000 + rank)
    with PipelineRunner(
        build,
        source.loss_fn,
        schedule=schedule,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=optimizer_factory(OPTIONS, LR),
        scheduler_factory=scheduler_factory(OPTIONS, 2 * HALF),
    ) as runner:
        losses: list[float] = []
        lost: tuple[str, ...] = ()
        if first:
            record = read_record(Path(ckdir) / "checkpoint.json")
            assert record is not None
            got = load_dcp_checkpoint(runner, ckdir, record)
            losses, lost = got["history"]["losses"], got["rng"]
        for k in range(first, first + steps):
            losses.append(runner.step(*_batch(k)))
        if not first:
            save_dcp_checkpoint(ckdir, runner, steps, steps * BATCH, {"losses": losses}, {})
        return {"losses": losses, "state": dict(runner.state_dict()), "lost": lost}


@pytest.mark.distributed
def test_dropout_resumes_bit_for_bit_on_its_stages_whatever_the_schedule(tmp_path: Path) -> None:
    """2 stages with dropout: 4 steps, checkpoint, 4 more in the same layout, and 4 more under
    another schedule (each rank keeps its stages), equal 8 uninterrupted steps to the bit."""
    build = str(make_build(DROPOUT, tmp_path / "b", 2, BATCH, MICROBATCHES))
    ck = str(tmp_path / "ck")
    whole = spawn(_dropout_job, 2, build, str(tmp_path / "u"), 0, 2 * HALF, "1f1b", timeout=240)
    spawn(_dropout_job, 2, build, ck, 0, HALF, "1f1b", timeout=240)
    for schedule in ("1f1b", "gpipe"):
        resumed = spawn(_dropout_job, 2, build, ck, HALF, HALF, schedule, timeout=240)
        for r, w in zip(resumed, whole):
            assert r.value["lost"] == ()
            assert r.value["losses"] == w.value["losses"], schedule
            for key, value in w.value["state"].items():
                assert torch.equal(r.value["state"][key], value), (schedule, key)


def test_rng_streams_follow_the_stages_and_the_log_names_those_that_start_afresh() -> None:
    """``rng_source``: a rank continues the saving rank that held its stages with the same
    replicas and microbatches; ``layout_note`` names the stages whose streams do not carry."""
    from types import SimpleNamespace

    from fxpipe.runtime.train.dcp_checkpoint import rng_key, rng_source
    from fxpipe.runtime.train.reshard_resume import layout_note
    from fxpipe.runtime.train.resume import ResumePlan

    stage = SimpleNamespace(source_sha256="abc")
    manifest = SimpleNamespace(num_stages=2, stages=[stage, stage])

    def runner(rank: int, stages: list[int], replicas: int, schedule: str) -> Any:
        return SimpleNamespace(
            rank=rank,
            stages=dict.fromkeys(stages),
            manifest=manifest,
            replica=rank // 2,
            layout=SimpleNamespace(replicas=replicas, tensor_parallel=1),
            tp_rank=0,
            schedule=SimpleNamespace(num_microbatches=2, name=schedule),
            device=SimpleNamespace(type="cpu"),
        )

    def key(stages: list[int]) -> str:
        return rng_key(stages, manifest, (0, 1), (0, 1), 2, "1f1b", "cpu")  # type: ignore[arg-type]

    meta = {"rng": {"0": key([0]), "1": key([1])}, "layout": {}}
    assert rng_source(meta, runner(0, [1], 1, "gpipe")) == 1  # its stage's streams, any schedule
    assert rng_source(meta, runner(0, [0, 1], 1, "1f1b")) is None  # another stage set
    assert rng_source(meta, runner(2, [0], 2, "1f1b")) is None  # another replica count
    plan = ResumePlan(step=4, carried="the weights, the RNG and the data position")
    note = layout_note(plan, {}, {}, ("stages 0, 1",))
    assert note.carried == "the weights, the data position (in samples)"
    assert (
        "the RNG streams of the ranks holding stages 0, 1 are not carried over" in note.changes[-1]
    )
    assert layout_note(plan, {}, {}, ()) == plan


def _hf_old_format_job(rank: int, world: int, build: str, ckdir: str) -> list[float]:
    """GPT-2 (tied embeddings across the 2 stages) 4 steps, then the per-rank checkpoint."""
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.train.checkpoint import save_training_checkpoint, training_state

    source = load_model_file(EXAMPLES / "hf_lm.py")
    batch = source.example_call(BATCH)
    with PipelineRunner(
        build,
        None,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=optimizer_factory(OPTIONS, HF_LR),
        scheduler_factory=scheduler_factory(OPTIONS, 2 * HALF),
    ) as runner:
        losses = [runner.step(batch) for _ in range(HALF)]
        state = training_state(runner, HALF, 0, {"losses": losses})
        save_training_checkpoint(ckdir, runner.rank, runner.world_size, state, {})
        return losses


@pytest.mark.distributed
def test_a_converted_gpt2_checkpoint_keeps_its_tie_and_resumes_on_one_rank(tmp_path: Path) -> None:
    """The per-rank files of GPT-2 on 2 stages (its embedding and head a tie across them), with
    no record meta (the oldest format): converted, the tie is stored once and one rank resumes it
    on the trajectory of 4 more steps of 2 stages."""
    from fxpipe.cli import main
    from fxpipe.runtime.train.dcp_checkpoint import read_model_state

    a = make_build("hf_lm", tmp_path / "a", 2, BATCH, MICROBATCHES)
    b = make_build("hf_lm", tmp_path / "b", 1, BATCH, MICROBATCHES)
    old, new, ref = tmp_path / "old", tmp_path / "new", tmp_path / "ref"
    spawn(_hf_old_format_job, 2, str(a), str(old), timeout=240)
    spawn(_hf_job, 2, str(a), str(ref), False, timeout=240)  # the same 4 steps, model-keyed
    assert main(["checkpoint", "convert", str(old), str(new), "--build", str(a)]) == 0
    stored = read_model_state(new)
    assert stored["lm_head.weight"] is stored["transformer.wte.weight"]
    want = read_model_state(ref)
    assert set(stored) == set(want)
    for key, value in want.items():
        assert torch.equal(stored[key], value), key
    (converted,) = spawn(_hf_job, 1, str(b), str(new), True, timeout=240)
    (direct,) = spawn(_hf_job, 1, str(b), str(ref), True, timeout=240)
    assert converted.value["losses"] == direct.value["losses"]
    for key, value in direct.value["state"].items():
        assert torch.equal(converted.value["state"][key], value), key


def test_checkpoint_convert_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --build, no checkpoint in OLD, a model-keyed OLD, a NEW that holds files: one line each."""
    from fxpipe.cli import main
    from fxpipe.runtime.train.commit import CommitRecord, write_record

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    cases = [
        ([], "needs --build BUILD"),
        (["--build", str(tmp_path)], "holds no checkpoint (no checkpoint.json)"),
    ]
    for extra, line in cases:
        assert main(["checkpoint", "convert", str(old), str(new), *extra]) != 0
        assert line in capsys.readouterr().err
    record = CommitRecord(id="x", partial=True, num_parts=0, parts={}, meta={"format": "dcp"})
    write_record(old / "checkpoint.json", record, "x")
    assert main(["checkpoint", "convert", str(old), str(new), "--build", str(tmp_path)]) != 0
    assert f"already holds a model-keyed checkpoint: resume it with --resume-from {old}" in (
        capsys.readouterr().err
    )
    write_record(
        old / "checkpoint.json", CommitRecord(id="y", partial=True, num_parts=0, parts={}), "y"
    )
    new.mkdir()
    (new / "something").write_text("")
    assert main(["checkpoint", "convert", str(old), str(new), "--build", str(tmp_path)]) != 0
    assert "is not an empty directory" in capsys.readouterr().err
    assert not new.joinpath("checkpoint.json").exists()
