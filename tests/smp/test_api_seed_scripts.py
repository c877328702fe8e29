"""The seed document's examples (``examples/seed_scripts``) on 2 ranks, against one-process PyTorch.

Two spawned jobs, each running several trainings: the training loop (SGD with
momentum under 1F1B and under zero-bubble ZB-H1, Adam under GPipe), manual partitioning with nested blocks, a
prebuilt ``plan``, checkpoints (partial and full, resumed by a fresh model), the
pipeline-aware GradScaler skipping a step on an injected inf, and a GPT whose
embeddings are tied across the two stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from builds import make_build
from oracle import train_one_process
from scenarios import checkpoint_job, training_job
from seedscripts import load_script
from spawn import spawn

TIGHT = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    plan_dir = make_build(
        "mlp", tmp_path_factory.mktemp("plan") / "build", stages=2, batch_size=8, microbatches=2
    )
    results = spawn(training_job, 2, str(plan_dir), timeout=300)
    return [r.value for r in results], plan_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    directory = tmp_path_factory.mktemp("ckpt")
    return [r.value for r in spawn(checkpoint_job, 2, str(directory), timeout=300)], directory


def _reference(
    optimizer: str, steps: int, microbatches: int
) -> tuple[list[float], Any, Any, tuple[float, int]]:
    script = load_script("train_loop")
    torch.manual_seed(0)
    model = script.Net()
    opt = script.make_optimizer(optimizer, model.parameters())
    losses = train_one_process(model, opt, script.batches(steps, 8), microbatches, F.nll_loss)
    model.eval()
    test_data = script.batches(2, 8, seed=2)
    with torch.no_grad():
        outputs = [(model(x), y) for x, y in test_data]
    test_loss = sum(F.nll_loss(o, y, reduction="sum").item() for o, y in outputs) / 16
    correct = sum(int(o.argmax(1).eq(y).sum()) for o, y in outputs)
    return losses, model, opt, (test_loss, correct)


@pytest.mark.parametrize(
    "case, optimizer, microbatches", [("sgd", "sgd", 4), ("adam", "adam", 2), ("zb-h1", "sgd", 4)]
)
def test_training_loop_matches_one_process(
    training: Any, case: str, optimizer: str, microbatches: int
) -> None:
    values, _ = training
    losses, model, opt, evaluation = _reference(optimizer, 4, microbatches)
    for rank in values:
        torch.testing.assert_close(rank[case]["losses"], losses, **TIGHT)
        test_loss, correct = rank[case]["test"]  # the seed's forward-only test_step, under no_grad
        assert correct == evaluation[1]
        torch.testing.assert_close(test_loss, evaluation[0], **TIGHT)
        got = rank[case]["state_dict"]
        assert list(got) == list(model.state_dict())  # the original keys, in the original order
        torch.testing.assert_close(got, model.state_dict(), **TIGHT)
        full_opt = rank[case]["optimizer"]
        want = opt.state_dict()
        assert full_opt["param_groups"] == want["param_groups"]
        torch.testing.assert_close(full_opt["state"], want["state"], **TIGHT)
    # each rank holds only its own stage's parameters, and together all of them
    keys = [set(rank[case]["local_keys"]) for rank in values]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    assert keys[0] | keys[1] == {k for k, _ in model.named_parameters()}


def test_config_reaches_the_planner(training: Any) -> None:
    values, _ = training
    assert values[0]["adam_plan_optimize"] == "memory"


def test_manual_partition_with_nested_blocks(training: Any) -> None:
    values, _ = training
    assert values[0]["manual"]["modules"] == ["child0", "child2"]  # innermost block wins for child1
    assert values[1]["manual"]["modules"] == ["child1", "child3"]  # child3: default_partition 1
    script = load_script("manual_partition")
    torch.manual_seed(0)
    model = script.Model()
    losses = train_one_process(
        model, torch.optim.SGD(model.parameters(), lr=0.1), script.data(3), 2, F.cross_entropy
    )
    for rank in values:
        torch.testing.assert_close(rank["manual"]["losses"], losses, **TIGHT)
        torch.testing.assert_close(rank["manual"]["state_dict"], model.state_dict(), **TIGHT)


def test_prebuilt_plan_trains_the_wrapped_model(training: Any) -> None:
    values, _ = training
    from fxpipe.modelfile import load_model_file

    source = load_model_file(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
    torch.manual_seed(7)
    model = source.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    data = [(source.example_inputs(8)[0], source.example_targets(8))] * 3
    losses = train_one_process(model, opt, data, 2, source.loss_fn)
    for rank in values:
        torch.testing.assert_close(rank["plan"]["losses"], losses, **TIGHT)
        torch.testing.assert_close(rank["plan"]["state_dict"], model.state_dict(), **TIGHT)
        assert rank["plan"]["hook_calls"] == [
            True
        ]  # ran once, after partitioning; the removed one never


def test_usage_errors_are_actionable(training: Any) -> None:
    values, _ = training
    for rank in values:
        assert "does not divide the world size 2" in rank["world_error"]
        errors = rank["errors"]
        assert "outside a @step function" in errors["forward"]
        assert "outside a @step function" in errors["backward"]
        assert "first call of the @step function" in errors["local"]


def test_rank_functions(training: Any) -> None:
    values, _ = training
    for r, rank in enumerate(values):
        assert rank["ranks"] == {
            "rank": r,
            "size": 2,
            "local_rank": r,
            "local_size": 2,
            "mp_rank": r,
            "mp_size": 2,
            "dp_rank": 0,
            "dp_size": 1,
            "tracing": False,
            "groups": True,
            "broadcast": {"from": 1},
        }


def test_checkpoints_resume_like_a_run_that_never_stopped(checkpoints: Any) -> None:
    values, directory = checkpoints
    # one file per mp_rank for the partial save, one file for the full save, a commit record for each
    # (fxpipe.runtime.train.commit), no temporary files left
    assert sorted(p.name for p in directory.iterdir()) == [
        "full.pt",
        "full.pt.full.json",
        "partial.pt.partial.json",
        "partial.pt_0",
        "partial.pt_1",
    ]
    for rank in values:
        rest = rank["uninterrupted"][2:]
        torch.testing.assert_close(rank["partial"], rest, **TIGHT)
        torch.testing.assert_close(rank["full"], rest, **TIGHT)


def test_grad_scaler_skips_the_step_on_every_stage(checkpoints: Any) -> None:
    values, _ = checkpoints
    for rank in values:
        record = rank["scaler"]
        assert [r["stepped"] for r in record] == [
            True,
            False,
            True,
        ]  # the inf was only on mp_rank 0
        assert [r["scale"] for r in record] == [1024.0, 512.0, 512.0]
    assert values[0]["scaler"] == values[1]["scaler"]


def test_tied_weights_across_stages(checkpoints: Any) -> None:
    values, _ = checkpoints
    from fxpipe.modelfile import load_model_file

    source = load_model_file(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
    torch.manual_seed(0)
    model = source.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = source.example_inputs(4)[0], source.example_targets(4)
    losses = train_one_process(model, opt, [(x, y)] * 3, 2, source.loss_fn)
    for rank in values:
        assert rank["tied"]["ties"] == 1  # wte.weight / lm_head.weight live on both stages
        torch.testing.assert_close(rank["tied"]["losses"], losses, **TIGHT)
        # the tied gradient is summed across stages, so it rounds differently from one accumulation
        torch.testing.assert_close(
            rank["tied"]["state_dict"], model.state_dict(), rtol=1e-4, atol=1e-5
        )
