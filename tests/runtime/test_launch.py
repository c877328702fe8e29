"""``run_build`` / the worker entry point: torchrun end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from builds import EXAMPLES, make_build, original_model
from fxpipe.cli import main
from fxpipe.errors import ConfigError
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.launch.launcher import free_port, run_build, torchrun_command
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.run_record import RunRecord
from reference import reference_train
from test_record import RUN_JSON_FIELDS

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")


def test_torchrun_command_uses_pytorchs_launcher() -> None:
    cmd = torchrun_command("build", 3, 29400, ["--steps", "2"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    joined = " ".join(cmd)
    assert "--nproc-per-node 3" in joined and "--rdzv-backend c10d" in joined
    assert "--rdzv-endpoint 127.0.0.1:29400" in joined and joined.endswith(
        "-m fxpipe.runtime.launch.worker build --steps 2"
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_run_build_trains_gpt_on_three_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build = make_build("gpt", tmp_path / "gpt", stages=3, batch_size=8, microbatches=2)
    result = run_build(
        build, RunOptions(steps=3, schedule="gpipe", microbatches=4, lr=0.1, timeout_s=60)
    )
    printed = capsys.readouterr().out
    assert "step    3/3  loss" in printed and "samples/s" in printed
    assert result.to_dict() == json.loads((build / "run.json").read_text())
    assert result.world_size == 3 and result.schedule == "gpipe" and result.microbatches == 4
    assert len(result.step_seconds) == 3 and all(s > 0 for s in result.step_seconds)
    assert len(result.peak_memory_bytes) == 3 and all(b > 1 << 20 for b in result.peak_memory_bytes)
    assert result.predicted_step_ms is None  # the plan was made for 2 microbatches, not 4
    source = load_model_file(EXAMPLES / "gpt.py")
    want, _ = reference_train(
        original_model(build, source, 3),
        source.example_inputs(8),
        source.example_targets(8),
        source.loss_fn,
        3,
        4,
        0.1,
    )
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want))

    # refused in this process before torchrun starts (fxpipe.runtime.launch.preflight), not by the ranks
    with pytest.raises(
        ConfigError, match=r"^batch size 8 does not split into 3 equal microbatches"
    ):
        run_build(build, RunOptions(steps=1, microbatches=3), quiet=True)


def test_run_build_refuses_bad_data_parallel_options_before_launching(tmp_path: Path) -> None:
    build = make_build("mlp", tmp_path / "mlp", stages=2, batch_size=4, microbatches=2)
    with pytest.raises(ConfigError, match=r"--dp must be an int >= 1.*got 0"):
        run_build(build, RunOptions(dp=0))
    with pytest.raises(ConfigError, match=r"unknown comm_hook 'gzip'"):
        run_build(build, RunOptions(dp=2, data_parallel=DataParallelOptions(comm_hook="gzip")))
    with pytest.raises(
        ConfigError, match=r"--steps 3 is not a multiple of --backward-passes-per-step 2.*--steps 4"
    ):
        run_build(
            build,
            RunOptions(
                steps=3, dp=2, data_parallel=DataParallelOptions(backward_passes_per_step=2)
            ),
        )
    # with one replica there is no DDP: these options would be silently ignored, so they are refused
    for option in (
        {"comm_hook": "powersgd"},
        {"shard_optimizer_state": True},
        {"backward_passes_per_step": 2},
    ):
        with pytest.raises(ConfigError, match=r"only apply with 2 or more pipeline replicas"):
            run_build(build, RunOptions(steps=2, data_parallel=DataParallelOptions(**option)))  # type: ignore[arg-type]
    assert not (build / "run.json").exists()


@pytest.mark.distributed
def test_worker_under_your_own_torchrun_reads_flags_and_infers_the_replicas(tmp_path: Path) -> None:
    """docs/training.md "Several machines, and failures": the worker module with flags, no --dp, no --options."""
    build = make_build("mlp", tmp_path / "mlp", stages=2, batch_size=4, microbatches=2)
    out = tmp_path / "elsewhere.json"
    cmd = torchrun_command(
        build, 2, free_port(), ["--steps", "2", "--schedule", "gpipe", "--out", str(out)]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = RunRecord.from_json(out)
    assert (
        len(result.losses) == 2
        and result.schedule == "gpipe"
        and result.dp == 1
        and result.world_size == 2
    )
    assert not (build / "run.json").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_run_build_two_stages_two_replicas_equals_one_process_on_the_whole_batch(
    tmp_path: Path,
) -> None:
    """2 stages x 2 replicas: replica r trains on rows [rB, (r+1)B) of example_inputs(2B); the
    replica-averaged losses equal one process training on all 2B rows in 2 x 2 microbatches."""
    stages, replicas, batch, micro, steps, lr = 2, 2, 4, 2, 3, 0.1
    build = make_build("mlp", tmp_path / "mlp", stages=stages, batch_size=batch, microbatches=micro)
    result = run_build(
        build,
        RunOptions(steps=steps, schedule="1f1b", lr=lr, timeout_s=60, dp=replicas),
        quiet=True,
    )
    assert result.dp == replicas and result.world_size == stages * replicas
    assert result.comm_hook == "allreduce" and result.batch_size == batch
    assert result.global_batch_size == batch * replicas
    assert len(result.peak_memory_bytes) == 4 and all(b > 1 << 20 for b in result.peak_memory_bytes)
    source = load_model_file(EXAMPLES / "mlp.py")
    n = batch * replicas
    want, _ = reference_train(
        original_model(build, source, stages),
        source.example_inputs(n),
        source.example_targets(n),
        source.loss_fn,
        steps,
        micro * replicas,
        lr,
    )
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want))
    assert want[-1] < want[0]  # it trained


SEQUENCE_FIRST = """
import torch
import torch.nn as nn

class SeqFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask):  # x: [T, B, C], mask: [T, T] shared by every sample
        return self.out(torch.einsum("st,tbc->sbc", mask, torch.relu(self.inp(x))))

def build_model():
    torch.manual_seed(0)
    return SeqFirst()

def example_inputs(b):
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, b, 8, generator=g), torch.tril(torch.ones(6, 6))

def example_targets(b):
    g = torch.Generator().manual_seed(2)
    return torch.randn(6, b, 8, generator=g)

def loss_fn(out, target):
    return ((out - target) ** 2).mean()
"""


@pytest.mark.distributed
def test_sequence_first_batches_split_inputs_and_targets_along_their_batch_dim(
    tmp_path: Path,
) -> None:
    """Through the command line: `fxpipe run` hands its flags to the workers as RunOptions JSON."""
    from fxpipe.codegen import write_build_dir
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    model_file = tmp_path / "seq_first.py"
    model_file.write_text(SEQUENCE_FIRST)
    source = load_model_file(model_file)
    traced = trace_model_file(source, 2, progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    write_build_dir(traced, plan, tmp_path / "build", source, batch_size=4, microbatches=2)
    assert (
        main(["run", str(tmp_path / "build"), "--steps", "2", "--lr", "0.1", "--timeout", "60"])
        == 0
    )
    run_json = json.loads((tmp_path / "build" / "run.json").read_text())
    assert set(run_json) == RUN_JSON_FIELDS | {"schema_version"}
    result = RunRecord.from_dict(run_json)
    assert (len(result.losses), result.lr, result.dp, result.batch_size, result.microbatches) == (
        2,
        0.1,
        1,
        4,
        2,
    )

    model = source.build_model()  # the same weights: the build was traced from this seeded model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, mask), y = source.example_inputs(4), source.example_targets(4)
    want = []
    for _ in range(2):
        opt.zero_grad()
        losses = [
            source.loss_fn(model(x[:, i : i + 2], mask), y[:, i : i + 2]) for i in (0, 2)
        ]  # batch on dim 1
        (sum(losses) / 2).backward()
        opt.step()
        want.append(sum(float(v) for v in losses) / 2)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want))


def test_a_build_named_like_an_option_reaches_the_worker_as_a_path() -> None:
    """``fxpipe run ./-b``: the workers' parser must not take ``-b`` for an option (#35 item 16)."""
    from fxpipe.runtime.launch.launcher import _torchrun_args
    from fxpipe.runtime.launch.worker import parse_args

    args = _torchrun_args(Path("-b"), 2, 0, ["--steps", "2"])
    worker = args[args.index("fxpipe.runtime.launch.worker") + 1 :]
    parsed = parse_args(worker)
    assert parsed.build_dir == Path("-b") and parsed.steps == 2
