"""``fxpipe run`` runs the plan's configuration: its replicas and sharding are the defaults (``with_plan_defaults``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from builds import EXAMPLES, original_model
from fxpipe.cli import main
from fxpipe.codegen.manifest import Manifest
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import PartitionPlan
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.train.run_options import (
    RunOptions,
    add_run_arguments,
    explicit_fields,
    with_plan_defaults,
)
from fxpipe.runtime.train.run_record import RunRecord
from reference import reference_train

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")


def _plan(tmp_path: Path, replicas: int, shard: str) -> PartitionPlan:
    profile = tmp_path / "profile.json"
    out = tmp_path / "plan.json"
    assert (
        main(["trace", str(EXAMPLES / "mlp.py"), "--batch-size", "2", "--out", str(profile)]) == 0
    )
    extra = ["--dp", str(replicas)] + (["--shard", shard] if shard != "none" else [])
    assert (
        main(["plan", str(profile), "--stages", "2", "--solver", "dp", "--out", str(out), *extra])
        == 0
    )
    plan = PartitionPlan.from_json(out)
    assert (plan.cost.dp_replicas, plan.cost.shard) == (replicas, shard)
    return plan


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_plans_replicas_and_sharding_are_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan(tmp_path, 2, "optimizer")
    capsys.readouterr()
    options = with_plan_defaults(RunOptions(), plan)
    assert options.dp == 2 and options.data_parallel.shard == "optimizer"
    # flags win: another width keeps the plan's sharding; one replica cannot shard; --shard none is kept
    assert with_plan_defaults(RunOptions(dp=4), plan).data_parallel.shard == "optimizer"
    one = with_plan_defaults(RunOptions(dp=1), plan)
    assert one.dp == 1 and one.data_parallel.shard == "none"
    given = _args("--shard", "none")
    kept = with_plan_defaults(RunOptions(), plan, explicit_fields(given))
    assert kept.dp == 2 and kept.data_parallel.shard == "none"
    # a level given in an --options file counts as given too
    file = tmp_path / "opts.json"
    RunOptions(dp=2, data_parallel=DataParallelOptions(shard="full")).to_json(file)
    assert "data_parallel.shard" in explicit_fields(_args("--options", str(file)))
    assert (
        with_plan_defaults(
            RunOptions(dp=2, data_parallel=DataParallelOptions(shard="full")),
            plan,
            explicit_fields(_args("--options", str(file))),
        ).data_parallel.shard
        == "full"
    )
    # no plan, or a plan of one replica: one replica, options as given
    assert with_plan_defaults(RunOptions(), None).dp == 1
    single = replace(plan, cost=replace(plan.cost, dp_replicas=1, shard="none"))
    assert with_plan_defaults(RunOptions(), single) == RunOptions(dp=1)


def test_run_refuses_more_ranks_than_gpus_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fxpipe.errors import RuntimeSetupError
    from fxpipe.runtime.launch import launcher as launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        RuntimeSetupError,
        match=r"^2 stages x 2 replicas = 4 ranks, but this machine has 2 GPUs; "
        r"run --dp 1",
    ):
        launch._check_world(torch.device("cuda", 0), 2, 2)
    launch._check_world(torch.device("cpu"), 2, 2)  # CPU ranks share the cores


@pytest.mark.distributed
@pytest.mark.slow
def test_partition_on_four_devices_then_run_trains_the_plans_replicas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Planning and running are one path: the search's S x R (here 2 x 2) is what `fxpipe run` starts."""
    build = tmp_path / "build"
    assert (
        main(
            [
                "partition",
                str(EXAMPLES / "mlp.py"),
                "--devices",
                "4",
                "--stages",
                "2",
                "--global-batch",
                "8",
                "--schedule",
                "gpipe",
                "--out",
                str(build),
            ]
        )
        == 0
    )
    plan = PartitionPlan.from_json(build / "plan.json")
    manifest = Manifest.from_json(build)
    replicas, micro = plan.cost.dp_replicas, manifest.microbatches
    assert replicas == 2 and manifest.num_ranks == 2 and manifest.batch_size * replicas == 8
    capsys.readouterr()
    assert main(["run", str(build), "--steps", "3", "--lr", "0.1", "--timeout", "120"]) == 0
    record = RunRecord.from_json(build / "run.json")
    assert record.world_size == 4 and record.dp == 2 and record.global_batch_size == 8
    assert record.microbatches == micro and record.schedule == "gpipe"
    assert record.shard_optimizer_state == (plan.cost.shard == "optimizer")
    source = load_model_file(EXAMPLES / "mlp.py")
    want, _ = reference_train(
        original_model(build, source, manifest.num_stages),
        source.example_inputs(8),
        source.example_targets(8),
        source.loss_fn,
        3,
        replicas * micro,
        0.1,
    )
    torch.testing.assert_close(torch.tensor(record.losses), torch.tensor(want))
    assert json.loads((build / "run.json").read_text())["dp"] == 2
