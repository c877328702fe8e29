"""Stages honour ``train()`` / ``eval()``: built from the merged graph, guarded where the modes differ,
checked by the safety net before the build is swapped in, and verified in both modes.

Models: ``tests/mode_models.py`` (BatchNorm + dropout + stochastic depth CNN, two dropout
branches, flipped literals), plus the transformers GPT-2 example with dropout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx as fx
from codegen_support import build_sources, reference_with_build_weights
from torch.utils._pytree import tree_leaves

import fxpipe.codegen.render.emit as emit
from fxpipe.cli import main
from fxpipe.codegen import Manifest, load_pipeline, verify_build, write_build_dir
from fxpipe.errors import EquivalenceError
from fxpipe.modelfile import ModelSource, load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

MODELS = Path(__file__).resolve().parents[1] / "mode_models.py"
ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"


def _build(
    out: Path,
    source: ModelSource,
    stages: int,
    *,
    frontend: str = "auto",
    solver: str = "uniform",
    check: bool = True,
) -> Manifest:
    traced = trace_model_file(source, 2, frontend=frontend, progress=False)
    plan = plan_partition(
        traced.profile, stages, solver=solver, microbatches=stages, time_limit=5.0
    )
    return write_build_dir(
        traced, plan, out, source, batch_size=2 * stages, microbatches=stages, check=check
    )


def _seeded(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], seed: int = 3
) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [t.detach() for t in tree_leaves(model(*inputs))]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("stages", [2, 3])
def test_bn_dropout_stochastic_depth_cnn_is_exact_in_both_modes(
    tmp_path: Path, frontend: str, stages: int
) -> None:
    source = load_model_file(MODELS)
    manifest = _build(tmp_path / "b", source, stages, frontend=frontend)
    reference = reference_with_build_weights(source, manifest, tmp_path / "b")
    pipeline = load_pipeline(tmp_path / "b")
    x = source.example_inputs(4)
    _assert_equal(
        _seeded(pipeline.train(), x), _seeded(reference.train(), x)
    )  # same seed: same masks
    for key, buffer in reference.named_buffers():  # running statistics moved alike
        held = next(b for s in pipeline.stages for k, b in s.named_buffers() if k == key)
        torch.testing.assert_close(held, buffer, rtol=0, atol=0)
    reference.eval()
    pipeline.eval()
    first = _seeded(pipeline, x, seed=1)
    _assert_equal(_seeded(pipeline, x, seed=2), first)  # call after call
    _assert_equal(first, _seeded(reference, x))


def test_export_stage_source_reads_training(tmp_path: Path) -> None:
    source = load_model_file(MODELS)
    manifest = _build(tmp_path / "b", source, 2, frontend="export")
    text = build_sources(tmp_path / "b", manifest)
    assert "if self.training:\n" in text
    assert "self.num_batches_tracked.add_(1)" in text
    assert "if self.training else" in text  # the stochastic-depth value: the noisy one or the input
    assert (
        "F.dropout(x, 0.3, self.training)" in text
    )  # `x = F.adaptive_avg_pool2d(x, 1).flatten(1)`
    assert "True" not in text.replace("requires_grad=True", "")


def test_hf_gpt2_with_dropout_is_exact_in_both_modes(tmp_path: Path) -> None:
    source = load_model_file(ZOO / "gpt2.py")  # dropout 0.1 on embeddings, attention and residuals
    manifest = _build(tmp_path / "b", source, 2)
    reference = reference_with_build_weights(source, manifest, tmp_path / "b")
    pipeline = load_pipeline(tmp_path / "b")
    x = source.example_inputs(4)
    _assert_equal(_seeded(pipeline.train(), x), _seeded(reference.train(), x))
    reference.eval()
    pipeline.eval()
    _assert_equal(_seeded(pipeline, x, seed=1), _seeded(reference, x))
    _assert_equal(_seeded(pipeline, x, seed=2), _seeded(reference, x))


def test_dropout_on_two_branches_keeps_random_order_under_cpsat(tmp_path: Path) -> None:
    source = load_model_file(MODELS, model_fn="build_branchy", inputs_fn="sequence_inputs")
    traced = trace_model_file(source, 2, progress=False)
    plan = plan_partition(traced.profile, 3, solver="cpsat", microbatches=3, time_limit=5.0)
    stage_of = {u: s for s, st in enumerate(plan.stages) for u in st.units}
    random_units = [u.name for u in traced.profile.units if u.random]
    assert len(random_units) == 2
    assert [stage_of[u] for u in random_units] == sorted(stage_of[u] for u in random_units)
    write_build_dir(
        traced, plan, tmp_path / "b", source, batch_size=6, microbatches=3
    )  # the check passes
    reference = source.build_model()
    pipeline = load_pipeline(tmp_path / "b")
    x = source.example_inputs(6)
    _assert_equal(_seeded(pipeline.train(), x), _seeded(reference.train(), x))


def _drop_first(target_name: str):  # a broken emitter: the first such node is left out of its stage
    original = emit.rewrite_aten

    def broken(graph: fx.Graph) -> None:
        original(graph)
        node = next(
            (n for n in graph.nodes if getattr(n.target, "__name__", str(n.target)) == target_name),
            None,
        )
        if node is not None:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)

    return broken


def test_safety_net_refuses_a_broken_build_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = load_model_file(MODELS, model_fn="build_flip", inputs_fn="sequence_inputs")
    out = tmp_path / "b"
    _build(out, source, 2)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(emit, "rewrite_aten", _drop_first("tanh"))
    with pytest.raises(EquivalenceError) as info:
        _build(out, source, 2)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("the emitted stages differ from the model in train mode: ")
    assert "made by unit 'a'" in message or "unit '<root>'" in message, message
    assert "--no-check" in message
    assert {
        p.name: p.read_bytes() for p in out.iterdir()
    } == before  # the previous build is untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".b.")]


def test_verify_checks_both_modes_and_fails_on_an_unchecked_broken_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = load_model_file(MODELS, inputs_fn="example_inputs")
    out = tmp_path / "b"
    _build(out, source, 2, frontend="export")
    report = verify_build(out)
    assert report.ok and [m.mode for m in report.modes] == ["train", "eval"]
    assert all(m.buffers for m in report.modes)  # BatchNorm statistics are compared too
    assert main(["verify", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        "train mode OK" in printed
        and "eval mode OK" in printed
        and "grad head.weight" not in printed
    )
    assert main(["verify", str(out), "--all"]) == 0
    assert "grad head.weight" in capsys.readouterr().out

    monkeypatch.setattr(emit, "rewrite_aten", _drop_first("batch_norm"))
    _build(out, source, 2, frontend="export", check=False)
    monkeypatch.undo()
    report = verify_build(out)
    assert not report.ok and not report.mode(True).ok and not report.mode(False).ok
    assert main(["verify", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "MISMATCH" in printed and "eval mode MISMATCH" in printed


def test_partition_no_check_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "partition",
        f"{MODELS}:build_flip",
        "--inputs-fn",
        "sequence_inputs",
        "--stages",
        "2",
        "--solver",
        "uniform",
        "--out",
        str(tmp_path / "b"),
    ]
    monkeypatch.setattr(emit, "rewrite_aten", _drop_first("tanh"))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: the emitted stages differ from the model") and err.count("\n") == 1
    )
    assert not (tmp_path / "b").exists()
    assert main(args + ["--no-check"]) == 0
    assert (tmp_path / "b" / "manifest.json").is_file()
