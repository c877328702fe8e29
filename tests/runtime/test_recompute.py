"""A plan that recomputes a stage: the runtime runs its forward under torch.utils.checkpoint, trains the
same, and holds less activation memory, as the plan predicts."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from fxpipe.codegen import write_build_dir
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import CostModel, plan_partition
from fxpipe.runtime.launch.launcher import run_build
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.tracer import trace_model_file
from tests.runtime.test_memory import WIDE_MLP


@pytest.fixture(scope="module")
def recompute_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, object]]:
    """The wide MLP on 2 stages x 4 microbatches under GPipe (stage 0 holds all 4), with and without
    recomputing stage 0, on the same (uniform) split."""
    root = tmp_path_factory.mktemp("recompute")
    (root / "wide.py").write_text(textwrap.dedent(WIDE_MLP))
    source = load_model_file(root / "wide.py")
    batch, micro = 2048, 4
    traced = trace_model_file(source, batch // micro)
    out = {}
    for name, recompute in (("plain", ()), ("recompute", (True, False))):
        plan = plan_partition(
            traced.profile,
            2,
            schedule="gpipe",
            microbatches=micro,
            solver="uniform",
            cost=CostModel(recompute=recompute),
        )
        build = root / name
        write_build_dir(traced, plan, build, source, batch_size=batch, microbatches=micro)
        run = run_build(build, RunOptions(steps=3, schedule="gpipe", timeout_s=60), quiet=True)
        out[name] = (json.loads((build / "plan.json").read_text()), run)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_recomputing_a_stage_trains_the_same(recompute_runs) -> None:
    plain, redo = recompute_runs["plain"][1], recompute_runs["recompute"][1]
    assert [s["units"] for s in recompute_runs["plain"][0]["stages"]] == [
        s["units"] for s in recompute_runs["recompute"][0]["stages"]
    ]
    torch.testing.assert_close(
        torch.tensor(redo.losses), torch.tensor(plain.losses), rtol=1e-6, atol=1e-7
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_recomputing_a_stage_saves_the_predicted_activations(recompute_runs) -> None:
    (plain_plan, plain), (redo_plan, redo) = recompute_runs["plain"], recompute_runs["recompute"]
    predicted = (
        plain_plan["stages"][0]["memory"]["activations"]
        - redo_plan["stages"][0]["memory"]["activations"]
    )
    assert (
        predicted == 3 * plain_plan["stages"][0]["memory"]["activations"] // 4
    )  # 4 microbatches held -> 1
    measured = plain.peak_tensor_bytes[0] - redo.peak_tensor_bytes[0]
    print(
        f"stage 0 peak: {plain.peak_tensor_bytes[0]} -> {redo.peak_tensor_bytes[0]}, saved {measured}, "
        f"predicted {predicted}"
    )
    # Measured 0.61 x the prediction (751 KB of 1.23 MB): the recomputing stage's peak moves into its
    # backward, where the recomputed microbatch's activations meet the backward temporaries that the
    # memory model leaves out (see test_memory's xfail); the plain stage peaks with its 4 microbatches held.
    assert 0.5 * predicted <= measured <= 1.1 * predicted
    assert (
        abs(redo.peak_tensor_bytes[1] - plain.peak_tensor_bytes[1])
        <= 0.05 * plain.peak_tensor_bytes[1]
    )
