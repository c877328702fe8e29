"""Options declared once (fxpipe.optionspec): the flags, their help, the JSON and the seed keys all
come from the dataclass fields, and the options that two layers share are one declaration."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest

from fxpipe.errors import ConfigError
from fxpipe.optionspec import (
    Options,
    Switch,
    add_arguments,
    declarations_of,
    flags_of,
    from_namespace,
    group,
    namespace_values,
    option,
    option_of,
    same_as,
    seed_keys,
)


@dataclass(frozen=True, kw_only=True)
class _Inner(Options):
    what: ClassVar[str] = "inner options"

    hook: str = option(
        "allreduce",
        choices=("allreduce", "fp16"),
        help="hook: %(choices)s",
        seed_key="comm_hook",
        switches=(Switch("--half", "fp16", "the same as --hook fp16"),),
    )
    rank: int | None = option(None, metavar="K", none_means="none", help="a rank")
    quiet: bool = option(False, help="say less")
    hidden: float = option(1.5, flag=False, help="JSON only")


@dataclass(frozen=True, kw_only=True)
class _Outer(Options):
    what: ClassVar[str] = "outer options"
    json_schema_version: ClassVar[int | None] = 3

    steps: int = option(10, flag="--count", aliases=("-n",), help="steps")
    names: tuple[str, ...] = option((), repeat=True, metavar="NAME", help="names; repeatable")
    inner: _Inner = group(_Inner)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--count must be >= 1, got {self.steps}")


def _parser(cls: type, **kwargs: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls, **kwargs)  # type: ignore[arg-type]
    return parser


def test_flags_come_from_the_fields() -> None:
    assert flags_of(_Outer) == ["--count", "-n", "--names", "--hook", "--half", "--rank", "--quiet"]
    parser = _parser(_Outer)
    got = from_namespace(
        _Outer, parser.parse_args(["-n", "3", "--names", "a", "--names", "b", "--half", "--quiet"])
    )
    assert got == _Outer(steps=3, names=("a", "b"), inner=_Inner(hook="fp16", quiet=True))
    assert from_namespace(_Outer, parser.parse_args([])) == _Outer()
    text = " ".join(parser.format_help().split())
    assert "hook: allreduce, fp16 (default: allreduce)" in text and "a rank (default: none)" in text
    assert "steps (default: 10)" in text and "--hidden" not in text
    with pytest.raises(SystemExit):  # declared choices are argparse's
        parser.parse_args(["--hook", "int8"])
    with pytest.raises(
        ConfigError, match="--count must be >= 1, got 0"
    ):  # validation is the class's
        from_namespace(_Outer, parser.parse_args(["--count", "0"]))


def test_suppressed_flags_name_only_what_was_given() -> None:
    parser = _parser(_Outer, suppress=True)
    args = parser.parse_args(["--rank", "2", "--quiet"])
    assert namespace_values(_Outer, args) == {"inner": {"rank": 2, "quiet": True}}
    assert namespace_values(_Outer, parser.parse_args([])) == {}
    only = _parser(_Outer, only=("inner.rank",))
    assert [a.dest for a in only._actions if a.option_strings != ["-h", "--help"]] == ["inner.rank"]


def test_the_json_form() -> None:
    value = _Outer(steps=4, names=("x",), inner=_Inner(rank=2, hidden=2.5))
    data = value.to_dict()
    assert data == {
        "schema_version": 3,
        "steps": 4,
        "names": ["x"],
        "inner": {"hook": "allreduce", "rank": 2, "quiet": False, "hidden": 2.5},
    }
    assert _Outer.from_json(value.to_json()).inner == value.inner
    assert _Outer.from_dict({"inner": {"rank": 1}}) == _Outer(inner=_Inner(rank=1))
    with pytest.raises(ConfigError, match=r"unknown outer options \['stpes'\]"):
        _Outer.from_dict({"stpes": 1})
    with pytest.raises(ConfigError, match=r"unknown inner options \['rnak'\]"):
        _Outer.from_dict({"inner": {"rnak": 1}})
    with pytest.raises(ConfigError, match="outer options schema version 4 is newer"):
        _Outer.from_dict({"schema_version": 4})


def test_seed_keys_and_same_as() -> None:
    assert seed_keys(_Inner) == {"comm_hook": "hook"}

    @dataclass(frozen=True)
    class Again:
        hook: str = same_as(_Inner, "hook", seed_key=None)

    assert Again().hook == "allreduce"
    assert dataclasses.replace(option_of(_Inner, "hook"), seed_key=None) == option_of(Again, "hook")


# -- the declarations themselves ------------------------------------------------


def test_the_data_parallel_options_are_the_cost_models() -> None:
    """comm_hook, powersgd_rank, shard, ... : one declaration for the planner, the run and the seed config."""
    from fxpipe.partitioner.cost import CostModel
    from fxpipe.partitioner.plan_options import PlanOptions
    from fxpipe.runtime.dataparallel import DataParallelOptions

    shared = (
        "comm_hook",
        "powersgd_rank",
        "shard",
        "shard_reduce",
        "shard_param_dtype",
        "shard_reduce_dtype",
    )
    for name in shared:
        declared = option_of(CostModel, name)
        assert option_of(DataParallelOptions, name).help == declared.help
        assert option_of(DataParallelOptions, name).choices == declared.choices
        if name != "shard_reduce_dtype":
            assert option_of(PlanOptions, name).help == declared.help
    assert set(DataParallelOptions().cost_fields(2)) >= set(shared)
    assert option_of(PlanOptions, "precision") == option_of(CostModel, "precision")


def test_a_flag_that_several_verbs_take_is_declared_once() -> None:
    """--dp, --schedule, --virtual-stages, --optimizer, --microbatches, --precision, --comm-hook,
    ...: wherever two verbs' options classes give the same flag, one field declares it and the
    other takes it over with same_as (its default and choices may be the verb's own)."""
    from fxpipe.partitioner.cost import CostModel
    from fxpipe.partitioner.plan_options import PlanOptions
    from fxpipe.partitioner.search.args import ClusterOptions
    from fxpipe.runtime.train.run_options import RunOptions
    from fxpipe.tracer.trace_options import ModelTraceOptions

    sources: dict[str, set[str]] = {}
    for cls in (PlanOptions, ClusterOptions, RunOptions, ModelTraceOptions, CostModel):
        for flag, origin in declarations_of(cls).items():
            sources.setdefault(flag, set()).add(origin)
    twice = {flag: origins for flag, origins in sources.items() if len(origins) > 1}
    assert twice == {}
    for flag in ("--dp", "--schedule", "--virtual-stages", "--optimizer"):
        assert sources[flag] == {f"PlanOptions.{flag[2:].replace('-', '_')}"}
    assert declarations_of(RunOptions)["--comm-hook"] == "CostModel.comm_hook"


def test_the_seed_config_keys_are_kept() -> None:
    from fxpipe.smp.config import Config

    with pytest.raises(ConfigError) as info:
        Config.from_dict({"partitions": 2, "nope": 1})
    accepted = str(info.value).split("accepts ")[1]
    for key in (
        "partitions",
        "microbatches",
        "pipeline",
        "virtual_stages",
        "auto_partition",
        "default_partition",
        "optimize",
        "ddp",
        "plan",
        "comm_hook",
        "powersgd_rank",
        "shard_optimizer_state",
        "shard",
        "shard_reduce",
        "shard_wrap",
        "shard_min_params",
        "shard_param_dtype",
        "shard_reduce_dtype",
        "weights",
    ):
        assert repr(key) in accepted
    assert "data_parallel" not in accepted
    config = Config.from_dict(
        {"partitions": 2, "ddp": True, "comm_hook": "fp16", "shard_reduce_dtype": None}
    )
    assert config.data_parallel.comm_hook == "fp16" and config.check_world(4) == 2


def test_names_the_parser_lists_match_the_code_that_reads_them() -> None:
    from fxpipe.partitioner.plan_options import SOLVER_NAMES
    from fxpipe.partitioner.solve.planner import SOLVERS
    from fxpipe.tracer.frontend.frontends import FRONTENDS
    from fxpipe.tracer.trace_options import FRONTENDS as DECLARED

    assert set(SOLVER_NAMES) == set(SOLVERS) and FRONTENDS is DECLARED
