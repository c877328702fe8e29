"""One build for every sequence length (#36): dynamic dimensions declared or inferred, stages that
read sizes from their inputs, formulas in the manifest, errors that name the place and the range.

Each check is against the model itself in one process: ``load_pipeline`` at lengths other than the
traced one gives the model's outputs, loss and gradients (fp32), in train and eval mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxpipe.codegen import Manifest, load_pipeline, write_build_dir
from fxpipe.errors import FxpipeError, TraceError
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import PartitionPlan, plan_partition
from fxpipe.partitioner.report.terminal import print_plan_report
from fxpipe.tracer.profile import ModelProfile
from rich.console import Console
from fxpipe.shapeformula import UNKNOWN, evaluate, fit_dim
from fxpipe.tracer import trace_model, trace_model_file
from fxpipe.tracer.dynamic import SpecialisedError

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "tests" / "runtime" / "varlen_llama.py"
GPT = ROOT / "examples" / "gpt.py"
pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")


def _build(traced, out: Path, source=None, stages: int = 2) -> Path:
    plan = plan_partition(traced.profile, stages, microbatches=1)
    write_build_dir(traced, plan, out, source, batch_size=traced.profile.batch_size, microbatches=1)
    return out


def _same_as_model(pipe: nn.Module, model: nn.Module, call: dict, *, grads: bool) -> None:
    out, want = pipe(**call), model(**call)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    if grads:
        pipe.zero_grad(), model.zero_grad()
        out.loss.backward(), want.loss.backward()
        mine = {n: p.grad for stage in pipe.stages for n, p in stage.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(mine[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def llama_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = load_model_file(LLAMA)
    traced = trace_model_file(source, 2, progress=False)
    return _build(traced, tmp_path_factory.mktemp("llama") / "build", source)


def test_a_llama_traced_at_16_runs_at_every_length_in_train_and_eval(llama_build: Path) -> None:
    source = load_model_file(LLAMA)
    model = source.build_model()
    pipe = load_pipeline(llama_build)
    for mode in ("train", "eval"):
        getattr(pipe, mode)(), getattr(model, mode)()
        for length in (16, 33, 7):
            ids = torch.randint(0, 64, (3, length), generator=torch.Generator().manual_seed(length))
            _same_as_model(pipe, model, {"input_ids": ids, "labels": ids}, grads=mode == "train")


def test_stage_code_and_manifest_carry_sizes_not_numbers(llama_build: Path) -> None:
    manifest = Manifest.from_json(llama_build)
    assert [(r.name, r.min, r.max, r.traced) for r in manifest.dynamic] == [("seq", 2, 64, 16)]
    data = json.loads((llama_build / "manifest.json").read_text())
    outputs = {t["name"]: t["dims"] for t in data["stages"][0]["outputs"]}
    assert any(dims == ["mb", "seq", "32"] for dims in outputs.values()), outputs
    source = (llama_build / "stage_0.py").read_text()
    assert "input_ids.size(1)" in source and "arange(16" not in source
    assert "int64[mb, seq]" in source  # the docstring states the formulas
    profile = ModelProfile.from_json(llama_build / "profile.json")  # formulas and ranges round-trip
    assert profile.dynamic == manifest.dynamic
    console = Console(record=True, width=200)
    print_plan_report(PartitionPlan.from_json(llama_build / "plan.json"), profile, console)
    assert "priced at seq = 16 (the build runs 2..64)" in console.export_text()


def test_a_length_outside_the_range_is_one_error_before_any_stage_runs(llama_build: Path) -> None:
    pipe = load_pipeline(llama_build)
    ids = torch.zeros(2, 65, dtype=torch.long)
    with pytest.raises(FxpipeError, match=r"seq = 65 is outside the range 2\.\.64 .*traced"):
        pipe(input_ids=ids, labels=ids)


def test_a_version_4_manifest_reads_as_a_batch_only_build(
    llama_build: Path, tmp_path: Path
) -> None:
    data = json.loads((llama_build / "manifest.json").read_text())
    data.update(schema_version=4)
    data.pop("dynamic")
    for t in data["inputs"] + [t for s in data["stages"] for t in s["inputs"] + s["outputs"]]:
        t.pop("dims")
    old = Manifest.from_json(json.dumps(data))
    assert old.dynamic == () and old.step_sizes([(4, 99)]) == {}
    spec = old.stages[0].outputs[-1]
    assert spec.shape_at(6, old.microbatch_size) == (6, *spec.shape[1:])


def test_the_gpt_example_names_the_guard_and_runs_in_the_range_that_holds(tmp_path: Path) -> None:
    """Its mask buffer is sliced by the length: export finds the guard ``seq != 16``."""
    source = load_model_file(GPT)
    model = source.build_model()
    x = torch.randint(0, 64, (2, 8))
    with pytest.raises(SpecialisedError, match=r"specialises the dynamic dimension seq: .*!= 16"):
        trace_model(
            model, (x,), dynamic_dims={"idx": {1: "seq"}}, frontend="export", progress=False
        )
    traced = trace_model(
        model, (x,), dynamic_dims={"idx": {1: ("seq", 2, 15)}}, frontend="export", progress=False
    )
    symbolic = trace_model_file(  # attention kept whole (it slices its buffer by x.shape)
        source, 2, frontend="symbolic", dynamic_dims={"idx": {1: ("seq", 2, 16)}}, progress=False
    )
    assert (traced.frontend, symbolic.frontend) == ("export", "symbolic")
    for t, high in ((traced, 15), (symbolic, 16)):
        pipe = load_pipeline(_build(t, tmp_path / t.frontend, source, stages=3)).eval()
        reference = t.model.eval()
        for length in (3, 8, high):
            ids = torch.randint(0, 64, (2, length))
            torch.testing.assert_close(pipe(ids), reference(ids), rtol=1e-5, atol=1e-6)


class _Baked(nn.Module):
    """Reads the length as a constant: 16 tokens of width 4 flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(64, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx).reshape(idx.size(0), 64))


def test_a_symbolic_graph_that_bakes_the_length_names_the_node() -> None:
    x = torch.randint(0, 10, (2, 16))
    with pytest.raises(TraceError, match=r"fails at seq = 32: node 'reshape'.*specialises seq"):
        trace_model(
            _Baked(), (x,), dynamic_dims={"idx": {1: "seq"}}, frontend="symbolic", progress=False
        )


def test_dynamic_auto_finds_the_sequence_dimension(tmp_path: Path) -> None:
    model_file = tmp_path / "plain_llama.py"
    text = LLAMA.read_text().replace("def dynamic_dims()", "def _unused()")
    model_file.write_text(text)
    source = load_model_file(model_file)
    traced = trace_model_file(source, 2, dynamic="auto", progress=False)
    assert [r.name for r in traced.profile.dynamic] == ["input_ids_1"]
    assert any(
        (o.dims or ())[:2] == ("mb", "input_ids_1") for u in traced.profile.units for o in u.outputs
    )
    assert trace_model_file(source, 2, progress=False).profile.dynamic == ()


def test_formulas_fit_products_offsets_and_refuse_what_does_not_fit() -> None:
    def fit(base: int, mb: int, seq: int, both: int) -> str:
        """The formula of a dimension of size ``base`` at mb 2, seq 16; ``mb`` at mb 4; ``seq`` at seq 32;
        ``both`` at mb 4 and seq 32."""
        return fit_dim(base, {"mb": (2, 4, mb), "seq": (16, 32, seq)}, {"mb": 2, "seq": 16}, both)

    assert fit(32, 64, 64, 128) == "mb*seq" and fit(16, 16, 32, 32) == "seq"
    assert fit(17, 17, 33, 33) == "seq+1" and fit(8, 8, 16, 16) == "seq//2"
    assert fit(32, 32, 32, 32) == "32" and fit(48, 48, 96, 96) == "3*seq"
    assert fit(7, 7, 9, 9) == UNKNOWN  # 7 -> 9 as seq doubles: no integer slope
    assert fit(18, 20, 34, 40) == UNKNOWN  # mb + seq: fits neither form
    assert fit(16, 16, 32, 33) == UNKNOWN  # the run with every size changed disagrees
    assert evaluate("2*seq+1", {"seq": 8}) == 17
