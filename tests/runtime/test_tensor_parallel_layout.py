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
        (dict(data_parallel=DataParallelOptions(shard="optimizer")), "--shard optimizer"),
        (dict(data_parallel=DataParallelOptions(comm_hook="fp16")), "--comm-hook fp16"),
        (
            dict(data_parallel=DataParallelOptions(shard="full", shard_param_dtype="bfloat16")),
            "--shard-param-dtype/--shard-reduce-dtype",
        ),
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


@pytest.mark.parametrize("shard", ["grad-op", "full"])
def test_tp_combines_with_fsdp_levels(shard: str) -> None:
    """--shard grad-op and full run FSDP over the stage's tp shards (Note [FSDP over TP];
    tests/runtime/test_tensor_parallel_fsdp.py), with clipping too."""
    RunOptions(
        tp=2,
        dp=2,
        data_parallel=DataParallelOptions(shard=shard),
        training=TrainingOptions(clip_grad_norm=1.0),
    )


def test_tp_combines_with_clipping_fp16_and_checkpoints() -> None:
    """Gradient clipping, fp16 and checkpoints run under --tp (tests/runtime/
    test_tensor_parallel_compose.py); a checkpoint's layout says its tp degree."""
    from fxpipe.runtime.train.dcp_checkpoint import describe_layout

    RunOptions(
        tp=2,
        precision="fp16",
        training=TrainingOptions(checkpoint_dir="ckpt", clip_grad_norm=1.0),
    )
    layout = {"num_stages": 2, "stage_ranks": [0, 1], "replicas": 1, "schedule": "1f1b"}
    assert describe_layout({**layout, "tensor_parallel": 2}) == (
        "2 stages on 2 ranks x tp 2 x 1 replicas (1f1b)"
    )
    assert describe_layout(layout) == "2 stages on 2 ranks x 1 replicas (1f1b)"


def test_dtensor_regions_on_a_one_rank_mesh_compute_the_module(tmp_path) -> None:
    """The plan applied over a mesh of one rank: outputs and gradients equal the plain module's
    (the hooks, CPU attention's sharding rule and implicit replication, in one process); a plan
    naming a module the stage lacks is refused."""
    import copy
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
    from test_tp_plan import Stage  # a tiny attention + SwiGLU + fused-qkv stage

    from fxpipe.codegen.tp_plan import ResolvedStagePlan, find_stage_plan
    from fxpipe.runtime.pipeline.tensor_parallel import implicit_replication_on, parallelize_stage

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        stage = Stage()
        plain = copy.deepcopy(stage)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        plan = find_stage_plan(stage, 0).for_degree(1)
        parallelize_stage(stage, plan, mesh)
        assert isinstance(stage.attn.q.weight, DTensor)
        ids = torch.randint(0, 10, (2, 5))
        mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
        with implicit_replication_on():
            out = stage(ids, mask)
            assert not isinstance(out, DTensor)
            out.square().mean().backward()
        want = plain(ids, mask)
        want.square().mean().backward()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(stage.named_parameters(), plain.parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        wrong = ResolvedStagePlan({"attn.nope": "colwise"}, ("attn.nope",), (), ("attn",))
        with pytest.raises(ConfigError, match="names module 'attn.nope'"):
            parallelize_stage(copy.deepcopy(plain), wrong, mesh)
    finally:
        dist.destroy_process_group()
