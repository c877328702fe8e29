"""The cluster search: its pruning never changes the answer, recompute only where memory binds, its plan."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from fxpipe.cli import main
from fxpipe.errors import ConfigError, InfeasibleError
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.partitioner.cost import SHARD_LEVELS
from fxpipe.partitioner.prediction import RUNTIME_COSTS, rank_peak_memory
from fxpipe.partitioner.problem import build_problem
from fxpipe.partitioner.search.configurations import (
    SearchResult,
    plan_configuration,
    scale_profile,
    search_configurations,
)
from fxpipe.partitioner.synthetic import transformer_profile


WORKSPACE = RUNTIME_COSTS["cuda"].workspace_bytes  # every CUDA rank's cuBLAS workspaces


def _device(mib: float) -> int:
    """A toy device's memory: the libraries' workspace plus ``mib`` MiB for the model."""
    return WORKSPACE + int(mib * 2**20)


def _small(layers: int = 6):
    """A small decoder: ~1 MiB of fp32 parameters and ~2.9 MiB of activations per sample per block."""
    return transformer_profile(
        layers=layers,
        hidden=128,
        ffn=512,
        heads=4,
        kv_heads=2,
        vocab=512,
        seq=512,
        device_tflops=0.05,
    )


def _all_scores(result: SearchResult) -> list[tuple[float, str]]:
    return sorted((round(s.step_ms, 6), s.config.label) for s in result.ranked)


def test_pruning_never_changes_the_best() -> None:
    profile, cluster = _small(), ClusterSpec(devices=8, device_memory=_device(20), node_size=4)
    pruned = search_configurations(profile, cluster, 16, top=3)
    everything = search_configurations(profile, cluster, 16, top=10**6)
    assert everything.priced > pruned.priced
    assert _all_scores(pruned) == _all_scores(everything)[:3]


def test_every_configuration_keeps_the_global_batch_and_the_devices() -> None:
    cluster = ClusterSpec(devices=8, device_memory=None, node_size=4)
    result = search_configurations(_small(), cluster, 12, top=10**6)
    assert len(result.ranked) > 20
    for score in result.ranked:
        c = score.config
        assert c.stages * c.replicas <= 8
        assert c.replicas * c.microbatches * c.microbatch_size == 12
        assert not any(c.recompute)  # no memory limit: memory never binds
        assert score.samples_per_s == pytest.approx(12 / (score.step_ms / 1e3))
    steps = [s.step_ms for s in result.ranked]
    assert steps == sorted(steps)


def test_recompute_only_where_memory_binds() -> None:
    profile = _small()
    cluster = ClusterSpec(devices=4, device_memory=_device(32), node_size=4)
    result = search_configurations(profile, cluster, 8, top=10**6, shard_levels=("none",))
    recomputing = [s for s in result.ranked if any(s.config.recompute)]
    assert 0 < len(recomputing) < len(result.ranked), (
        "the limit should make some configurations recompute"
    )
    for score in result.ranked:
        c = score.config
        assert score.peak_memory_bytes <= cluster.device_memory
        problem = build_problem(
            scale_profile(profile, c.microbatch_size),
            c.stages,
            schedule=c.schedule,
            microbatches=c.microbatches,
            virtual_stages=c.virtual_stages,
            cost=cluster.cost_model(c.replicas, optimizer="adam", shard=c.shard),
        )
        plain = rank_peak_memory(
            problem, score.assignment, c.schedule, RUNTIME_COSTS[profile.trace_device]
        )
        for s, flag in enumerate(
            c.recompute
        ):  # a stage recomputes only on a rank whose walk did not fit without it
            assert plain[problem.stage_ranks[s]] > cluster.device_memory if flag else True
        if any(c.recompute):
            assert score.recompute_ms > 0 and "memory-bound" in score.limit


def test_no_configuration_fits_names_the_least_memory() -> None:
    with pytest.raises(
        InfeasibleError,
        match=r"no configuration fits [\d.]+ MiB per device on 2 devices: each "
        r"needs at least [\d.]+ MiB",
    ):
        search_configurations(_small(), ClusterSpec(devices=2, device_memory=_device(1)), 4)


def test_bad_requests_are_config_errors() -> None:
    cluster = ClusterSpec(devices=2)
    with pytest.raises(ConfigError, match="global batch"):
        search_configurations(_small(), cluster, 0)
    with pytest.raises(ConfigError, match="shard level"):
        search_configurations(_small(), cluster, 2, shard_levels=("zero",))
    with pytest.raises(ConfigError, match="schedule"):
        search_configurations(_small(), cluster, 2, schedules=("pipedream",))


def test_result_round_trips_and_explains_every_group() -> None:
    cluster = ClusterSpec(devices=8, device_memory=_device(20), node_size=4)
    result = search_configurations(_small(), cluster, 16, top=2)
    assert SearchResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    groups = {(a.group, a.value) for a in result.alternatives}
    assert {("depth", str(s)) for s in range(1, 9)} <= groups
    assert {("shard", level) for level in SHARD_LEVELS} <= groups
    best = [a for a in result.alternatives if a.note.startswith("the best")]
    assert len(best) == 3  # its depth, schedule and sharding level
    assert all(a.note for a in result.alternatives)


def test_plan_of_the_best_configuration_prices_it_the_same_way() -> None:
    profile = _small()
    cluster = ClusterSpec(devices=4, device_memory=_device(17), node_size=2)
    result = search_configurations(
        profile, cluster, 8, shard_levels=("none",), schedules=("1f1b", "gpipe")
    )
    best = next(s for s in result.ranked if any(s.config.recompute))
    plan = plan_configuration(profile, cluster, best.config)
    c = best.config
    assert (plan.num_ranks, plan.microbatches, plan.schedule, plan.microbatch_size) == (
        c.stages,
        c.microbatches,
        c.schedule,
        c.microbatch_size,
    )
    assert plan.cost.recompute == c.recompute and plan.cost.dp_replicas == c.replicas
    assert max(plan.rank_memory_bytes) <= cluster.device_memory
    assert (
        max(plan.prediction.peak_memory_bytes) <= cluster.device_memory
    )  # the whole step's walk fits too
    assert best.peak_memory_bytes <= cluster.device_memory
    assert plan.step_ms <= best.step_ms * (
        1 + 1e-9
    )  # the planner starts from the same split and may improve it


def test_scale_profile_is_linear_in_the_batch() -> None:
    profile = _small(2)
    twice = scale_profile(profile, 2)
    assert twice.batch_size == 2
    for a, b in zip(profile.units, twice.units):
        assert (
            b.fwd_ms == pytest.approx(2 * a.fwd_ms) and b.activation_bytes == 2 * a.activation_bytes
        )
        assert b.param_bytes == a.param_bytes
    assert [e.bytes for e in twice.edges] == [2 * e.bytes for e in profile.edges]
    assert twice.units[1].outputs[0].shape[0] == 2
    assert scale_profile(profile, 1) is profile


def test_cli_plan_searches_a_cluster(tmp_path, capsys) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(_small().to_json())
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            str(profile),
            "--devices",
            "8",
            "--device-memory",
            f"{_device(20)}",
            "--node-size",
            "4",
            "--global-batch",
            "16",
            "--optimizer",
            "adam",
            "--explain",
            "--top",
            "3",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert (
        "Top 3 configurations on 8 devices (2 nodes of 4)" in text
        and "Why not another pipeline depth" in text
    )
    search = SearchResult.from_dict(json.loads((tmp_path / "plan.search.json").read_text()))
    plan = json.loads(out.read_text())
    assert plan["num_stages"] == search.best.config.stages * search.best.config.virtual_stages
    assert plan["cost"]["dp_replicas"] == search.best.config.replicas


def test_cli_plan_devices_needs_a_global_batch(tmp_path, capsys) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(_small().to_json())
    assert main(["plan", str(profile), "--devices", "8"]) == 2
    assert "add --global-batch G" in capsys.readouterr().err
    assert main(["plan", str(profile)]) == 2
    assert "give --stages N, or --devices N" in capsys.readouterr().err


def test_seventy_b_shaped_blocks_need_a_pipeline_and_fit() -> None:
    """A quarter of Llama-3-70B (20 of its blocks): ~280 GB of Adam training state, 16 devices of 80 GiB."""
    profile = transformer_profile(
        layers=20,
        hidden=8192,
        ffn=28672,
        heads=64,
        kv_heads=8,
        vocab=128256,
        seq=4096,
        device_tflops=400.0,
    )
    result = search_configurations(
        profile, ClusterSpec(devices=16, device_memory=80 * 2**30), 16, top=1
    )
    best = result.best
    assert best.peak_memory_bytes <= 80 * 2**30 and best.config.devices <= 16
    assert best.config.stages >= 2 or best.config.shard != "none"  # 280 GB fits no single device
    assert 0 < best.bubble < 1 and best.samples_per_s > 0


def test_the_search_counts_the_library_workspace() -> None:
    assert WORKSPACE > 0
    profile = _small()
    cluster = ClusterSpec(devices=4, device_memory=_device(64), node_size=4)
    result = search_configurations(profile, cluster, 8, top=10**6)
    bare = search_configurations(
        profile,
        ClusterSpec(devices=4, device_memory=64 * 2**20, node_size=4),
        8,
        top=10**6,
        runtime=replace(RUNTIME_COSTS["cuda"], workspace_bytes=0),
    )
    assert [s.config for s in result.ranked] == [s.config for s in bare.ranked]
    assert all(
        s.peak_memory_bytes - b.peak_memory_bytes == WORKSPACE
        for s, b in zip(result.ranked, bare.ranked)
    )
    with pytest.raises(
        InfeasibleError, match="needs at least"
    ) as caught:  # the workspace alone fills it
        search_configurations(
            profile, ClusterSpec(devices=4, device_memory=WORKSPACE, node_size=4), 8
        )
    needs = re.search(r"needs at least ([0-9.]+) MiB", str(caught.value))
    assert needs is not None and float(needs.group(1)) * 2**20 > WORKSPACE


def test_the_jobs_own_cost_fields_price_every_configuration() -> None:
    """Note [what the job prices]: bf16 gathers halve a fully sharded level's all-gathers and the
    gathered copy, so the same configuration is cheaper and never larger than with fp32 gathers;
    the plan of the chosen one is priced with them too."""
    profile = _small()
    cluster = ClusterSpec(devices=8, device_memory=_device(20), node_size=4)
    kwargs = dict(shard_levels=("full",), schedules=("1f1b",), top=10**6)
    fp32 = search_configurations(profile, cluster, 16, **kwargs)
    bf16 = search_configurations(
        profile, cluster, 16, cost_fields={"shard_param_dtype": "bfloat16"}, **kwargs
    )
    assert bf16.cost_fields == {"shard_param_dtype": "bfloat16"} and fp32.cost_fields == {}
    by_label = {s.config.label: s for s in fp32.ranked}
    sharded = [s for s in bf16.ranked if s.config.replicas > 1 and s.config.label in by_label]
    assert sharded
    for s in sharded:
        assert s.step_ms < by_label[s.config.label].step_ms
        assert s.peak_memory_bytes <= by_label[s.config.label].peak_memory_bytes
    best = next(s for s in bf16.ranked if s.config.replicas > 1)
    plan = plan_configuration(profile, cluster, best.config, cost_fields=bf16.cost_fields)
    assert plan.cost.shard_param_dtype == "bfloat16"


def test_a_field_the_search_chooses_is_refused_as_a_job_field() -> None:
    profile, cluster = _small(2), ClusterSpec(devices=2)
    for name, value in (("shard", "full"), ("dp_replicas", 2), ("no_such_field", 1)):
        with pytest.raises(ConfigError, match=repr(name)):
            search_configurations(profile, cluster, 4, cost_fields={name: value})


def test_cli_plan_devices_prices_the_flags_it_was_given(tmp_path, capsys) -> None:
    """``--shard-param-dtype`` and ``--precision`` with ``--devices`` were read and dropped: the
    search now prices them, says so in its title, and the plan and search.json carry them."""
    profile = tmp_path / "profile.json"
    profile.write_text(_small().to_json())
    out = tmp_path / "plan.json"
    args = ["plan", str(profile), "--devices", "8", "--device-memory", f"{_device(20)}"]
    args += ["--node-size", "4", "--global-batch", "16", "--top", "2", "--out", str(out)]
    assert main(args + ["--shard-param-dtype", "bfloat16", "--precision", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "priced with the job's precision bf16, shard_param_dtype bfloat16" in text
    search = SearchResult.from_dict(json.loads((tmp_path / "plan.search.json").read_text()))
    assert search.cost_fields == {"precision": "bf16", "shard_param_dtype": "bfloat16"}
    plan = json.loads(out.read_text())
    assert plan["cost"]["precision"] == "bf16" and plan["cost"]["shard_param_dtype"] == "bfloat16"
