"""The seed API's pieces that need no process group: config, pin policy, StepOutput, checkpoint files."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from fxpipe.errors import ConfigError, FxpipeError
from fxpipe.smp import CheckpointError, Config, StepOutput, apply_partition_policy, load, partition
from fxpipe.smp.checkpoint import save
from fxpipe.tracer import trace_model


@pytest.mark.parametrize(
    "config, message",
    [
        ({"partitions": 2, "microbatchs": 4}, "unknown config key(s) ['microbatchs']"),
        ({"microbatches": 4}, "no 'partitions'"),
        ({"partitions": 0}, "'partitions' must be an int >= 1, got 0"),
        ({"partitions": 2, "microbatches": 0}, "'microbatches' must be an int >= 1, got 0"),
        (
            {"partitions": 2, "pipeline": "1F1B"},
            "'pipeline' must be one of ['1f1b', 'dualpipev', 'gpipe', "
            "'interleaved', 'interleaved-1f1b', 'simple', 'zb-h1', 'zbv'], got '1F1B'",
        ),
        (
            {"partitions": 2, "pipeline": "zbv", "virtual_stages": 3},
            "'zbv' runs 2 stages per rank, not virtual_stages 3",
        ),
        (
            {"partitions": 2, "default_partition": 2},
            "'default_partition' must be a partition index in 0..1, got 2",
        ),
        (
            {"partitions": 2, "optimize": "fast"},
            "'optimize' must be 'speed' or 'memory', got 'fast'",
        ),
        ({"partitions": 2, "ddp": "yes"}, "'ddp' must be True or False"),
        (
            {"partitions": 2, "compile": True, "compile_backward": "split"},
            "'compile_backward' must be one of ['graph', 'halves'], got 'split'",
        ),
        (
            {"partitions": 2, "compile": True, "compile_unchecked": "yes"},
            "'compile_unchecked' must be True or False, got 'yes'",
        ),
        ({"partitions": 2, "plan": "/nonexistent/build"}, "has no manifest.json"),
        ({"partitions": 2, "comm_hook": "int8"}, "unknown comm_hook 'int8'"),
        ({"partitions": 2, "powersgd_rank": 0}, "powersgd_rank must be an int >= 1, got 0"),
        (
            {"partitions": 2, "shard_optimizer_state": 1},
            "'shard_optimizer_state' must be True or False",
        ),
    ],
)
def test_bad_configs_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(config)
    assert message in str(info.value)


def test_config_defaults_and_world_check() -> None:
    cfg = Config.from_dict({"partitions": 2, "pipeline": "simple"})
    assert (cfg.microbatches, cfg.schedule, cfg.auto_partition, cfg.optimize) == (
        1,
        "gpipe",
        True,
        "speed",
    )
    assert Config.from_dict({"partitions": 2}).schedule == "1f1b"
    assert Config.from_dict({"partitions": 2}).compile_backward == "halves"
    assert Config.from_dict({"partitions": 2, "pipeline": "zb-h1"}).schedule == "zb-h1"
    assert cfg.check_world(2) == 1
    with pytest.raises(ConfigError, match="'partitions' 2 does not divide the world size 3"):
        cfg.check_world(3)
    with pytest.raises(ConfigError, match="needs 'ddp': True"):
        cfg.check_world(4)
    assert Config.from_dict({"partitions": 2, "ddp": True}).check_world(6) == 3
    dp = Config.from_dict(
        {
            "partitions": 2,
            "ddp": True,
            "comm_hook": "powersgd",
            "powersgd_rank": 2,
            "shard_optimizer_state": True,
        }
    ).data_parallel_options(backward_passes_per_step=2)
    assert (
        dp.comm_hook,
        dp.powersgd_rank,
        dp.shard_optimizer_state,
        dp.backward_passes_per_step,
    ) == ("powersgd", 2, True, 2)


class _Pinned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with partition(1):
            self.a = nn.Linear(4, 4)
            with partition(2):
                self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)) + 1)


def test_partition_policy() -> None:
    profile = trace_model(_Pinned(), (torch.randn(2, 4),), progress=False).profile
    pins = {u.module_path: u.pin for u in profile.units}
    assert (pins["a"], pins["b"], pins["c"]) == (1, 2, None)
    manual = apply_partition_policy(
        profile, Config(partitions=3, auto_partition=False, default_partition=2)
    )
    got = {u.module_path: u.pin for u in manual.units}
    assert (got["a"], got["b"], got["c"]) == (
        1,
        2,
        2,
    )  # nested block wins; c gets default_partition
    glue = dataclasses.replace(
        profile,
        units=tuple(
            dataclasses.replace(u, module_path="") if u.name == "c" else u for u in profile.units
        ),
    )
    freed = apply_partition_policy(
        glue, Config(partitions=3, auto_partition=False, default_partition=2)
    )
    assert [u.pin for u in freed.units] == [
        1,
        2,
        None,
    ]  # top-level glue ops stay free for the solver
    auto = apply_partition_policy(profile, Config(partitions=3))
    assert all(u.pin is None for u in auto.units)
    with pytest.raises(ConfigError, match=r"fxpipe.partition\(2\), but 'partitions' is 2"):
        apply_partition_policy(profile, Config(partitions=2, auto_partition=False))


def test_step_output_reductions() -> None:
    out = StepOutput((torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])))
    torch.testing.assert_close(out.reduce_mean(), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(out.reduce_sum(), torch.tensor([4.0, 8.0]))
    torch.testing.assert_close(out.concat(), torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert out.stack().shape == (2, 2)
    with pytest.raises(TypeError, match="use .outputs"):
        StepOutput(("a", "b")).stack()


class _Payload:
    """Not plain data: loading it would need to import and build this class."""


def test_load_refuses_pickled_code(tmp_path, monkeypatch) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"x": _Payload()}, path)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load(str(path), partial=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load(str(tmp_path / "missing.pt"), partial=False)


def test_save_is_atomic_and_round_trips(tmp_path, monkeypatch) -> None:
    from fxpipe.smp import state

    class _Fake:  # the fields save/load read, without a process group
        rank = 0
        mp_rank = 1
        mp_group = None
        layout = type("Layout", (), {"num_stages": 2})

    monkeypatch.setattr(state, "_STATE", _Fake())
    obj = {"w": torch.arange(3.0), "step": 4, "_smp_is_partial": True}
    save(obj, str(tmp_path / "ck.pt"), partial=True)
    # the part and its commit record; no temporary file left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt.partial.json", "ck.pt_1"]
    loaded = load(str(tmp_path / "ck.pt"), partial=True)
    torch.testing.assert_close(loaded["w"], obj["w"])
    assert loaded["step"] == 4 and loaded["_smp_is_partial"] is True


def test_api_needs_init() -> None:
    from fxpipe.smp import DistributedModel, rank

    for call in (rank, lambda: DistributedModel(nn.Linear(2, 2))):
        with pytest.raises(FxpipeError, match=r"fxpipe.init\(config\) has not been called"):
            call()


def test_package_root_exposes_the_seed_surface() -> None:
    """`import fxpipe as smp` must offer every name a seed script uses."""
    import fxpipe
    import fxpipe.smp as api

    seed_names = set(api.__all__) - {
        "PARTIAL_KEY",
        "Config",
        "DDPOptions",
        "GradScaler",
        "apply_partition_policy",
    }
    missing = sorted(n for n in seed_names if not hasattr(fxpipe, n))
    assert not missing, f"fxpipe does not re-export {missing}"
    assert fxpipe.amp.GradScaler is api.GradScaler
    assert fxpipe.partition is fxpipe.tracer.partition


def test_configs_of_the_ranks_are_compared_key_by_key(tmp_path: Path) -> None:
    from fxpipe.smp.config_agreement import config_values, first_difference

    def values(**config: Any) -> dict[str, Any]:
        return config_values(Config.from_dict({"partitions": 2, **config}))

    assert first_difference([values(), values(), values()]) is None
    assert first_difference([values(), values(shard="optimizer", ddp=True)]) == (
        "config 'ddp' differs across ranks (rank 0: False, rank 1: True); every rank must call fxpipe.init with "
        "the same config"
    )  # the data-parallel keys are compared too, by their seed names
    assert first_difference([values(), values(shard="optimizer")])[:14] == "config 'shard'"
    many = [values(microbatches=2)] * 5 + [values(microbatches=4)]
    assert "(ranks 0, 1, 2, 3, ... (5 ranks): 2, rank 5: 4)" in first_difference(many)
    # a plan is the build it names: a copy at another path agrees, another build does not
    for name, text in (("a", "{}"), ("b", "{}"), ("c", '{"other": 1}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
    assert (
        first_difference([values(plan=str(tmp_path / "a")), values(plan=str(tmp_path / "b"))])
        is None
    )
    message = first_difference([values(plan=str(tmp_path / "a")), values(plan=str(tmp_path / "c"))])
    assert message.startswith(
        f"config 'plan' differs across ranks (rank 0: '{tmp_path / 'a'}' (manifest "
    )


def test_an_uneven_batch_names_the_config_key_not_a_cli_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seed-API user sets 'microbatches' in fxpipe.init's config; there is no --microbatches (#35 item 16)."""
    import importlib
    from types import SimpleNamespace

    step_module = importlib.import_module("fxpipe.smp.step")
    monkeypatch.setattr(
        step_module,
        "current",
        lambda: SimpleNamespace(model=object(), config=SimpleNamespace(microbatches=3)),
    )
    # one process, no pipeline: no rank to take the batch from (Note [one batch per pipeline])
    monkeypatch.setattr(step_module, "first_stage_batch", lambda fn, args, kwargs: (args, kwargs))

    @step_module.step
    def train(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ConfigError) as info:
        train(torch.zeros(4, 2))
    assert "set 'microbatches' in fxpipe.init's config to one of [1, 2, 4]" in str(info.value)
    assert "--microbatches" not in str(info.value)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_config_plans_with_compiled_prices(compiled: bool) -> None:
    """``"compile": True`` prices the units as compiled stages run them, as ``fxpipe trace
    --compile`` does: the plan rank 0 makes records the compiled-kernel factor it applied."""
    from fxpipe.partitioner import PartitionPlan
    from fxpipe.smp.partitioning import TraceOptions, _plan_on_rank0
    from fxpipe.tracer.measure.calibration import DEVICE_PRESETS

    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    files = _plan_on_rank0(
        model,
        (torch.randn(4, 8),),
        Config(partitions=2, microbatches=2, compile=compiled),
        TraceOptions(),
        8,  # the batch: two microbatches of the traced 4
        None,
        None,
    )
    plan = PartitionPlan.from_json(files[0]["plan.json"].decode())
    want = DEVICE_PRESETS["cpu"].compile_factor if compiled else None
    assert plan.compile_factor == want
