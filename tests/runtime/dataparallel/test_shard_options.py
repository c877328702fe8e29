"""Sharding without processes: options, the flags, wrap policies and the cost model's prices."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.nn as nn

from fxpipe.cli import build_parser, main
from fxpipe.errors import ConfigError, InfeasibleError
from fxpipe.partitioner import CostModel, plan_partition
from fxpipe.partitioner.cost import DataParallelTraffic
from fxpipe.runtime.dataparallel import DataParallelOptions, block_units, min_params_units
from fxpipe.runtime.dataparallel.fsdp_units import called_children, root_child_units, split_units
from fxpipe.runtime.train.run_options import RunOptions, run_options_from_args
from fxpipe.smp.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "partitioner"))
from partition_fixtures import chain_profile  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MB = 10**6


def test_shard_levels_and_the_older_spelling() -> None:
    assert DataParallelOptions(shard_optimizer_state=True) == DataParallelOptions(shard="optimizer")
    assert DataParallelOptions(shard="optimizer").shard_optimizer_state
    assert (
        not DataParallelOptions(shard="full").shard_optimizer_state
        and DataParallelOptions(shard="full").fsdp
    )
    old_json = {
        "comm_hook": "allreduce",
        "shard_optimizer_state": True,
    }  # a run options file from before `shard`
    assert DataParallelOptions.from_dict(old_json).shard == "optimizer"
    options = DataParallelOptions(
        shard="full",
        shard_reduce="microbatch",
        shard_wrap="params",
        shard_min_params=10,
        shard_param_dtype="bfloat16",
        shard_reduce_dtype="float32",
    )
    assert DataParallelOptions.from_dict(options.to_dict()) == options


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"shard": "zero3"},
            r"unknown shard level 'zero3'; expected one of \['none', 'optimizer', 'grad-op', 'full'\]",
        ),
        ({"shard": "full", "shard_optimizer_state": True}, "contradicts shard='full'"),
        (
            {"shard": "full", "comm_hook": "powersgd"},
            "no counterpart of the DDP options comm_hook='powersgd'",
        ),
        ({"shard": "grad-op", "bucket_cap_mb": 5.0}, "bucket_cap_mb=5.0"),
        (
            {"shard": "optimizer", "shard_reduce": "microbatch"},
            "only apply to shard='grad-op' or 'full'",
        ),
        ({"shard_param_dtype": "bfloat16"}, "only apply to shard='grad-op' or 'full'"),
        (
            {"shard": "full", "shard_wrap": "params"},
            "shard_wrap='params' and shard_min_params go together",
        ),
        ({"shard": "full", "shard_min_params": 100}, "go together"),
        ({"shard": "full", "shard_param_dtype": "int8"}, "shard_param_dtype must be one of"),
        ({"shard": "full", "shard_reduce": "never"}, "unknown shard_reduce 'never'"),
    ],
)
def test_bad_sharding_options_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataParallelOptions(**kwargs)


def test_sharding_with_one_replica_is_refused_everywhere() -> None:
    with pytest.raises(
        ConfigError, match=r"shard='full' only apply with 2 or more pipeline replicas"
    ):
        RunOptions(dp=1, data_parallel=DataParallelOptions(shard="full"))
    with pytest.raises(ConfigError, match=r"shard='optimizer'.*only apply with 2 or more"):
        RunOptions(dp=1, data_parallel=DataParallelOptions(shard_optimizer_state=True))
    for key, value in (
        ("shard", "full"),
        ("shard_optimizer_state", True),
    ):  # the seed API said nothing before
        with pytest.raises(ConfigError, match="one data-parallel replica"):
            Config.from_dict({"partitions": 2, "ddp": True, key: value}).check_world(2)
    assert Config.from_dict({"partitions": 2, "ddp": True, "shard": "full"}).check_world(4) == 2
    assert (
        Config.from_dict(
            {"partitions": 2, "ddp": True, "shard": "grad-op", "shard_reduce": "microbatch"}
        )
        .data_parallel_options()
        .shard_reduce
        == "microbatch"
    )


def test_run_flags() -> None:
    def cli(*flags: str) -> RunOptions:
        return run_options_from_args(
            build_parser().parse_args(["run", "build", "--dp", "2", *flags])
        )

    got = cli(
        "--shard",
        "full",
        "--shard-reduce",
        "microbatch",
        "--shard-wrap",
        "params",
        "--shard-min-params",
        "64",
        "--shard-param-dtype",
        "bfloat16",
        "--shard-reduce-dtype",
        "float32",
    ).data_parallel
    assert (
        got.shard,
        got.shard_reduce,
        got.shard_wrap,
        got.shard_min_params,
        got.shard_param_dtype,
        got.shard_reduce_dtype,
    ) == ("full", "microbatch", "params", 64, "bfloat16", "float32")
    assert cli("--shard-optimizer-state").data_parallel == DataParallelOptions(shard="optimizer")
    with pytest.raises(SystemExit):
        cli("--shard", "zero3")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.fc(x)


def test_block_policy_picks_the_members_of_the_outermost_stacks() -> None:
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.blocks = nn.ModuleDict({"0": _Block(), "1": _Block(), "2": nn.ReLU()})
            self.head = nn.Sequential(nn.Linear(4, 4))  # a stack of one: its member is a unit too
            self.layers = nn.ModuleList(
                [nn.Sequential(_Block(), _Block())]
            )  # a stack inside a block: not split

    stage = Stage()
    units = block_units(stage)
    assert units == [stage.blocks["0"], stage.blocks["1"], stage.head[0], stage.layers[0]]
    seq = nn.Sequential(
        nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)
    )  # a stage that is itself a stack
    assert block_units(seq) == [seq[0], seq[2]]
    assert block_units(nn.Linear(3, 3)) == []  # nothing to split: the stage is one unit


class _Wide(nn.Module):
    """A block whose forward calls ``up`` and ``down``, reads ``peek``'s weight, loops ``twice``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 4)
        self.peek, self.twice = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = 0.5

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.down(self.up(self.norm(x))) * self.scale + x @ self.peek.weight
        for _ in range(2):
            h = self.twice(h)
        return h


class _Opaque(_Wide):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.helper(x)  # a method: nothing says which children it reads

    def helper(self, x):  # type: ignore[no-untyped-def]
        return self.up.weight.sum() + x


def test_a_block_over_the_limit_is_split_into_the_children_its_forward_calls() -> None:
    # Note [units small enough to save]: only children entered through their own forward, once
    block = _Wide()
    assert called_children(block) == {"norm", "up", "down"}
    assert called_children(_Opaque()) == set()

    class _Sub(_Wide):
        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.up(x) + super().forward(x)  # the parent's forward: unread

    assert called_children(_Sub()) == set()
    assert called_children(nn.Sequential(nn.Linear(2, 2))) == set()  # ``self`` iterated
    # over the limit: the called children become units, the block keeps peek and twice
    units = split_units([block], limit=100)
    assert units == [block.norm, block.up, block.down, block]
    assert split_units([block], limit=10_000) == [block]  # under it: unchanged
    assert split_units([_Opaque()], limit=1)[0].__class__ is _Opaque  # cannot tell: whole

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(10, 4)
            self.wte = nn.Embedding(10, 4)
            self.blocks = nn.ModuleDict({"0": _Wide(), "1": _Wide()})
            self.head = nn.Linear(4, 10, bias=False)
            self.tied = nn.Linear(4, 10, bias=False)
            self.tied.weight = self.wte.weight  # shared: both stay in the root

        def forward(self, idx):  # type: ignore[no-untyped-def]
            h = self.wte(idx) + self.pos(idx)
            for block in self.blocks.values():
                h = block(h)
            return self.head(h) + self.tied(h)

    stage = Stage()
    blocks = block_units(stage)
    # the root's called children get units (the stage's blocks as they were), the tied pair not
    assert root_child_units(stage, blocks, limit=10_000) == [stage.pos, *blocks, stage.head]


def test_min_params_policy_is_fairscales_auto_wrap() -> None:
    # FairScale's documented example: Transformer layers and their linear1/linear2 wrapped, self_attn not
    tfmr = nn.Transformer(
        d_model=64,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=256,
        batch_first=True,
    )
    units = min_params_units(tfmr, int(1e6 * (64 / 512) ** 2))
    for layer in tfmr.encoder.layers:
        assert layer in units and layer.linear1 in units and layer.linear2 in units
        assert layer.self_attn not in units and all(u is not layer.self_attn for u in units)
    assert (
        tfmr not in units and tfmr.encoder.layers not in units
    )  # the root, and a ModuleList (no forward)
    assert units.index(tfmr.encoder.layers[0].linear1) < units.index(
        tfmr.encoder.layers[0]
    )  # children first


def test_cost_model_prices_each_level() -> None:
    R, M, P = 2, 4, 8 * MB
    base = CostModel(link_bandwidth=1e9, link_latency=0.0, dp_replicas=R, optimizer="adam")
    shapes = [(2000, 1000)]

    def traffic(**kw: object) -> DataParallelTraffic:
        return CostModel(**{**base.to_dict(), **kw}).shard_traffic([P], shapes, microbatches=M)

    assert traffic() == DataParallelTraffic(all_reduce_bytes=P, collectives=1)
    assert traffic(shard="optimizer") == DataParallelTraffic(
        all_reduce_bytes=P, broadcast_bytes=P, collectives=2
    )
    assert traffic(shard="grad-op") == DataParallelTraffic(
        all_gather_bytes=P, reduce_scatter_bytes=P, collectives=2
    )
    assert traffic(shard="full") == DataParallelTraffic(
        all_gather_bytes=2 * M * P, reduce_scatter_bytes=P, collectives=2 * M + 1
    )
    assert traffic(shard="full", shard_reduce="microbatch").reduce_scatter_bytes == M * P
    bf16 = traffic(shard="full", shard_param_dtype="bfloat16", shard_reduce_dtype="float32")
    assert (bf16.all_gather_bytes, bf16.reduce_scatter_bytes) == (M * P, P)
    assert (
        traffic(shard="grad-op", shard_param_dtype="bfloat16").reduce_scatter_bytes == P / 2
    )  # reduced in bf16
    # padding: FSDP2 pads dim 0 to a multiple of R
    odd = CostModel(dp_replicas=4, shard="grad-op").shard_traffic([4 * 10 * 3], [(10, 3)])
    assert odd.all_gather_bytes == 4 * 12 * 3
    # the ring: (R-1)/R of every collective, twice for the all-reduce; 1 GB/s: bytes/1e6 ms
    assert traffic(shard="full").wire_bytes(R) == (2 * M + 1) * P / 2
    assert CostModel(**{**base.to_dict(), "shard": "full"}).dp_comm_ms(
        [P], shapes, M
    ) == pytest.approx(9 * 4.0)
    # memory per rank: (params, grads, optimizer state)
    assert base.stage_state_bytes(P) == (P, P, 2 * P)
    assert CostModel(**{**base.to_dict(), "shard": "optimizer"}).stage_state_bytes(P) == (P, P, P)
    assert CostModel(**{**base.to_dict(), "shard": "grad-op"}).stage_state_bytes(P) == (
        P + P // 2,
        P,
        P,
    )
    assert CostModel(**{**base.to_dict(), "shard": "full"}).stage_state_bytes(P) == (P // 2, P, P)
    assert CostModel(
        **{**base.to_dict(), "shard": "full", "shard_reduce": "microbatch"}
    ).stage_state_bytes(P) == (P // 2, P // 2, P)
    assert CostModel(shard="full").stage_state_bytes(P) == (
        P,
        P,
        0,
    )  # one replica: nothing to divide


def test_a_sharded_plan_has_less_memory_per_rank_and_prices_the_traffic() -> None:
    profile = chain_profile([1.0, 1.0, 1.0, 1.0], params=[8 * MB, 0, 0, 2 * MB])
    plans = {
        level: plan_partition(
            profile, 2, microbatches=4, cost=CostModel(dp_replicas=2, optimizer="adam", shard=level)
        )
        for level in ("none", "optimizer", "grad-op", "full")
    }
    mem = {
        k: [s.memory.params + s.memory.grads + s.memory.optimizer for s in p.stages]
        for k, p in plans.items()
    }
    assert (
        mem["none"][0] == 4 * 8 * MB
        and mem["full"][0] == 2.5 * 8 * MB
        and mem["optimizer"][0] == 3 * 8 * MB
    )
    assert all(s.dp_bytes > 0 for p in plans.values() for s in p.stages)
    assert (
        plans["full"].stages[0].dp_bytes
        > plans["grad-op"].stages[0].dp_bytes
        > plans["none"].stages[0].dp_bytes / 2
    )
    # a memory limit that only the sharded plan meets over the whole step (Note [fitting memory over time]):
    # full holds 2.5 x 8 MB of state, plus the gathered 8 MB weight's whole gradient while it is made
    limit = int(3.6 * 8 * MB)
    full = plan_partition(
        profile,
        2,
        microbatches=4,
        memory_limit=limit,
        cost=CostModel(dp_replicas=2, optimizer="adam", shard="full"),
    )
    assert full.memory_limit == limit and max(full.prediction.peak_memory_bytes) <= limit
    with pytest.raises(InfeasibleError):
        plan_partition(
            profile,
            2,
            microbatches=4,
            memory_limit=limit,
            cost=CostModel(dp_replicas=2, optimizer="adam"),
        )


def test_plan_shard_full_shows_memory_and_traffic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    assert (
        main(["trace", str(EXAMPLES / "mlp.py"), "--batch-size", "2", "--out", str(profile)]) == 0
    )
    out = tmp_path / "plan.json"
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                str(profile),
                "--stages",
                "2",
                "--optimizer",
                "adam",
                "--dp",
                "2",
                "--shard",
                "full",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["cost"]["shard"] == "full" and plan["cost"]["dp_replicas"] == 2
    for s in plan["stages"]:
        assert s["dp_bytes"] > 0 and s["dp_allreduce_ms"] > 0
        assert (
            s["memory"]["optimizer"] == s["memory"]["grads"] == 2 * s["memory"]["params"]
        )  # adam: 2P/2; G: P
    assert "shard full" in report and "dp comm ms" in report and "dp sent/step" in report
    assert main(["plan", str(profile), "--stages", "2", "--shard", "full", "--out", str(out)]) == 2
    assert "--dp is 1" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                str(profile),
                "--stages",
                "2",
                "--dp",
                "2",
                "--shard",
                "zero",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "unknown shard level 'zero'" in capsys.readouterr().err


def test_html_report_has_the_data_parallel_table(tmp_path: Path) -> None:
    from fxpipe.partitioner.report.html import render_html_report
    from fxpipe.tracer.profile import ModelProfile

    profile_path = tmp_path / "profile.json"
    assert (
        main(["trace", str(EXAMPLES / "mlp.py"), "--batch-size", "2", "--out", str(profile_path)])
        == 0
    )
    profile = ModelProfile.from_json(profile_path)
    plan = plan_partition(profile, 2, cost=CostModel(dp_replicas=2, shard="grad-op"))
    page = render_html_report(plan, profile)
    assert (
        "Data parallelism: 2 replicas, shard grad-op, reduce per step" in page
        and "sent per rank/step" in page
    )
    assert "Data parallelism" not in render_html_report(plan_partition(profile, 2), profile)
