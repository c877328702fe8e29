"""The (dp, pp, tp) rank layout, tp innermost, and the run options tensor parallelism refuses."""

from __future__ import annotations

import pytest

from fxpipe.errors import ConfigError, RuntimeSetupError
from fxpipe.runtime import RankLayout
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.training_options import TrainingOptions


def test_tp_ranks_are_neighbours_and_each_tp_index_has_its_pipelines() -> None:
    layout = RankLayout(num_stages=2, replicas=2, tensor_parallel=2)
    assert layout.world_size == 8
    assert [layout.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.tp_of(r) for r in range(8)] == [0, 1] * 4
    assert [layout.replica_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert layout.pipeline_ranks(0, 1) == (1, 3) and layout.pipeline_ranks(1, 0) == (4, 6)
    assert layout.data_parallel_ranks(1, 1) == (3, 7)
    assert all(
        layout.rank_of(layout.stage_of(r), layout.replica_of(r), layout.tp_of(r)) == r
        for r in range(8)
    )
    assert RankLayout.for_world(8, 2, tensor_parallel=2) == layout
    with pytest.raises(RuntimeSetupError, match="not a multiple of 2 pipeline ranks x tp 2"):
        RankLayout.for_world(6, 2, tensor_parallel=2)


@pytest.mark.parametrize(
    "options, flag",
    [
        (dict(data_parallel=DataParallelOptions(shard="full")), "--shard full"),
        (dict(data_parallel=DataParallelOptions(comm_hook="fp16")), "--comm-hook fp16"),
        (dict(precision="fp16"), "--precision fp16"),
        (dict(training=TrainingOptions(checkpoint_dir="ckpt")), "--checkpoint-dir"),
        (dict(training=TrainingOptions(clip_grad_norm=1.0)), "--clip-grad-norm"),
    ],
)
def test_run_options_refuse_what_tp_does_not_combine_with(options: dict, flag: str) -> None:
    RunOptions(tp=2, dp=2)
    with pytest.raises(ConfigError, match=f"--tp 2 does not combine with {flag}"):
        RunOptions(tp=2, **options)
    with pytest.raises(ConfigError, match="--tp must be an int >= 1"):
        RunOptions(tp=0)
    with pytest.raises(ConfigError, match="--tp-plan applies with --tp"):
        RunOptions(tp_plan="plan.json")
