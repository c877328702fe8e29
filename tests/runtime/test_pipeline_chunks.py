"""Interleaved, zero-bubble and V-shaped schedules (several stages per rank) train exactly like one process.

``chunked.ChainLM`` split one layer per stage, with its embedding tied between the first
and the last stage and a skip connection between them: under loop placement both cross
ranks, under V placement they stay on rank 0 (shared parameter, local hand-off). One
spawned job per world size runs every case; fp32, loss and every parameter to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import chunked
from fxpipe.errors import ConfigError, RuntimeSetupError
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.pipeline.runner import resolve_schedule
from fxpipe.runtime.pipeline.schedule import Action, Schedule
from reference import reference_train
from spawn import spawn

STEPS, LR, BATCH = 2, 0.5, 8
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
# (schedule, virtual stages, placement, microbatches); M = S and M = 2S
CASES = {
    1: [  # one rank: the loop and the V are one placement (a pipelined build on one GPU)
        ("zbv", 2, "v", 2),
        ("interleaved-1f1b", 2, "v", 4),
    ],
    2: [
        ("1f1b", 1, "loop", 4),
        ("zb-h1", 1, "loop", 4),
        ("interleaved-1f1b", 2, "loop", 2),
        ("interleaved-1f1b", 2, "loop", 4),
        ("zbv", 2, "v", 2),
        ("zbv", 2, "v", 4),
        ("dualpipev", 2, "v", 2),
        ("dualpipev", 2, "v", 4),
    ],
    4: [
        ("zb-h1", 1, "loop", 4),
        ("interleaved-1f1b", 2, "loop", 4),
        ("zbv", 2, "v", 8),
        ("dualpipev", 2, "v", 8),
    ],
}


def _own_schedule() -> Schedule:
    """A hand-written action list on 2 ranks: GPipe forwards, split backwards, every W at the very end."""
    lists = ["0F0 0F1 0B0 0B1 0W0 0W1", "1F0 1F1 1B0 1B1 1W0 1W1"]
    return Schedule(
        "mine", 2, 2, tuple(tuple(Action.parse(a) for a in line.split()) for line in lists)
    )


def _train(
    world: int, name: str | Schedule, v: int, placement: str, m: int, replicas: int = 1
) -> tuple:
    ranks = world // replicas
    runner = PipelineRunner(
        chunked.manifest(ranks, v, placement),
        chunked.loss_fn,
        stage_loader=chunked.stage_loader(ranks * v),
        schedule=name,
        microbatches=m,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=60,
        data_parallel=DataParallelOptions() if replicas > 1 else None,
    )
    inputs, target = chunked.example_batch(BATCH, seed=1 + runner.replica)
    losses = [runner.step(inputs, target) for _ in range(STEPS)]
    busy = {str(t.action) for t in runner.executor.last_step}
    return losses, runner.state_dict(), busy


def _job(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    out = {case: _train(world, *case) for case in CASES[world]}
    if world == 2:
        out["mine"] = _train(world, _own_schedule(), 1, "loop", 2)
    dist.destroy_process_group()
    return out


def _check(results: list[dict], world: int, cases: list) -> None:
    inputs, target = chunked.example_batch(BATCH)
    for case in cases:
        name, v, placement, m = case if isinstance(case, tuple) else ("mine", 1, "loop", 2)
        model = chunked.build_reference(world * v)
        want_losses, want_state = reference_train(
            model, inputs, target, chunked.loss_fn, STEPS, m, LR
        )
        seen: set[str] = set()
        for rank, res in enumerate(results):
            losses, state, actions = res[case]
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(want_losses),
                **TIGHT,
                msg=f"{case}: losses on rank {rank}",
            )
            for key, value in state.items():  # both tied copies of emb.weight included
                torch.testing.assert_close(
                    value, want_state[key], **TIGHT, msg=f"{case}: {key} on rank {rank}"
                )
            seen |= set(state)
            if name in ("zb-h1", "zbv", "mine") or (
                name == "dualpipev" and rank == 0
            ):  # its rank 0 splits 3B0
                assert any("W" in a for a in actions), f"{case}: no W ran on rank {rank}"
        assert seen == set(want_state), f"{case}: the ranks do not hold the whole model"


@pytest.mark.distributed
def test_schedules_train_like_one_process_on_2_ranks() -> None:
    results = [r.value for r in spawn(_job, 2, timeout=240)]
    _check(results, 2, CASES[2] + ["mine"])


@pytest.mark.distributed
def test_two_chunks_on_one_rank_train_like_one_process() -> None:
    results = [r.value for r in spawn(_job, 1, timeout=120)]
    _check(results, 1, CASES[1])


@pytest.mark.distributed
def test_schedules_train_like_one_process_on_4_ranks() -> None:
    results = [r.value for r in spawn(_job, 4, timeout=300)]
    _check(results, 4, CASES[4])


def _dp_job(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    out = {
        case: _train(world, *case, replicas=2)
        for case in [("zbv", 2, "v", 2), ("interleaved-1f1b", 2, "loop", 2)]
    }
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
def test_data_parallel_replicas_of_a_chunked_pipeline() -> None:
    """2 ranks x 2 replicas: DDP's all-reduce after the last W equals one process on both replicas' rows."""
    results = [r.value for r in spawn(_dp_job, 4, timeout=300)]
    (a_in, a_t), (b_in, b_t) = (
        chunked.example_batch(BATCH, seed=1),
        chunked.example_batch(BATCH, seed=2),
    )
    inputs = tuple(torch.cat([x, y]) for x, y in zip(a_in, b_in))
    for case in results[0]:
        _, v, _, m = case
        model = chunked.build_reference(2 * v)
        want_losses, want_state = reference_train(
            model, inputs, torch.cat([a_t, b_t]), chunked.loss_fn, STEPS, 2 * m, LR
        )
        for rank, res in enumerate(results):
            losses, state, _ = res[case]
            for key, value in state.items():
                torch.testing.assert_close(
                    value, want_state[key], **TIGHT, msg=f"{case}: {key} on rank {rank}"
                )
        mean = [(x + y) / 2 for x, y in zip(results[0][case][0], results[2][case][0])]
        torch.testing.assert_close(torch.tensor(mean), torch.tensor(want_losses), **TIGHT)


def test_a_build_runs_only_the_schedules_its_placement_fits() -> None:
    v_build = chunked.manifest(2, 2, "v", schedule="zbv")
    assert resolve_schedule(None, v_build, 4).name == "zbv"  # the build's own by default
    with pytest.raises(
        ConfigError,
        match=r"schedule 'interleaved-1f1b' cannot run this build: .* 2 per rank "
        r"placed 'v', which runs \['zbv', 'dualpipev'\]",
    ):
        resolve_schedule("interleaved-1f1b", v_build, 4)
    with pytest.raises(
        ConfigError,
        match="--virtual-stages 1 does not match the build, which has 2 stages per rank",
    ):
        resolve_schedule(None, v_build, 4, virtual_stages=1)
    loop_build = chunked.manifest(2, 2, "loop")
    assert resolve_schedule(None, loop_build, 2).name == "interleaved-1f1b"
    with pytest.raises(RuntimeSetupError, match="places the stages on ranks"):
        resolve_schedule(Schedule("wrong", 4, 1, ((), ()), (0, 1, 1, 0)), loop_build, 1)
    # on one rank the loop and the V are one placement: a build planned for ZBV runs every
    # two-chunk schedule (a one-GPU run of a pipelined build)
    one_rank = chunked.manifest(1, 2, "v", schedule="zbv")
    for name in ("zbv", "dualpipev", "interleaved-1f1b"):
        assert resolve_schedule(name, one_rank, 2).name == name
    assert resolve_schedule(None, one_rank, 2).name == "zbv"
