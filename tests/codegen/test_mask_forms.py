"""A causal mask the trace unrolled is written as its short form, and only when it computes it
(Note [short forms of mask helpers] in fxpipe.codegen.render.masks).

The unit tests trace mask functions written as transformers' ``sdpa_mask`` is recorded (aranges
offset by 0, unsqueeze chains, a lookup of the padding mask) with a static or a dynamic length; a
window or an offset, even one wider than the traced length, must not pass for the plain causal
mask. The build tests check the stage of a tiny transformers Llama and GPT-2 traced with a
dynamic length: the mask function is a few lines, and the stages equal the model at two other
lengths in both modes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fxpipe.codegen import load_pipeline, write_build_dir
from fxpipe.codegen.check.equivalence import compare_in_mode
from fxpipe.codegen.render.masks import short_form
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"
MAX_MASK_LINES = 6  # `def`, docstring, 3 statements (the traced operators took 28)


def _mask(attention_mask: Any, window: int | None = None, offset: int = 0) -> Any:
    """transformers' causal-and-padding mask, op for op as torch.export records it."""
    batch, length = attention_mask.size(0), attention_mask.size(1)
    device = attention_mask.device
    padding = attention_mask.to(device, torch.bool)
    kv = torch.arange(length, device=device) + offset
    q = torch.arange(length, device=device) + 0
    b = torch.arange(batch, device=device)[:].unsqueeze(1).unsqueeze(2).unsqueeze(3)
    qi = q.unsqueeze(0).unsqueeze(1).unsqueeze(3)
    ki = kv.unsqueeze(0).unsqueeze(1).unsqueeze(2)
    out = qi.new_ones([], dtype=torch.bool) & (ki <= qi).to(device=device, dtype=torch.bool)
    if window is not None:
        out = out & (qi <= ki + window)
    return (out & padding[b, ki].to(device=device, dtype=torch.bool)).expand(
        [batch, -1, length, length]
    )


def _graph(fn: Callable[[Any], Any], dynamic: bool) -> fx.Graph:
    """``fn`` traced, its argument's value a (2, 16) int64 mask whose length is a symbol when ``dynamic``."""
    graph = fx.symbolic_trace(fn).graph
    length = DimDynamic.DYNAMIC if dynamic else DimDynamic.STATIC
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, length])
    mode = FakeTensorMode(shape_env=ShapeEnv())
    val = mode.from_tensor(torch.ones(2, 16, dtype=torch.long), symbolic_context=context)
    for node in graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = val
        elif node.op == "output":
            node.args[0].meta["val"] = torch.empty(2, 1, 16, 16, dtype=torch.bool)
    return graph


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_causal_padding_mask_is_recognised(dynamic: bool) -> None:
    form = short_form(_graph(lambda m: _mask(m), dynamic))
    assert form is not None and form.key == "causal padding mask"


@pytest.mark.parametrize(
    ("dynamic", "change"),
    [
        (False, {"window": 3}),
        (True, {"window": 3}),
        (True, {"window": 20}),  # wider than the traced length: probed past it
        (False, {"offset": 1}),
        (True, {"offset": -1}),
    ],
)
def test_a_window_or_an_offset_is_not_the_causal_mask(dynamic: bool, change: dict) -> None:
    assert short_form(_graph(lambda m: _mask(m, **change), dynamic)) is None


def test_a_float_or_random_body_is_left_as_traced() -> None:
    assert short_form(_graph(lambda m: _mask(m) & (torch.rand(16) > 0.5), True)) is None
    assert short_form(_graph(lambda m: _mask(m * 1.0), True)) is None


def _function_lines(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(next(ln for ln in lines if ln.startswith(f"def {name}(")))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace())
    return [ln for ln in lines[start:end] if ln.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_decoder_stage_writes_its_causal_mask_in_a_few_lines(name: str, tmp_path: Path) -> None:
    sys.path.append(str(ZOO))
    try:
        import _zoo
    finally:
        sys.path.remove(str(ZOO))

    def call(batch: int, seq: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": _zoo.token_ids(batch, seq),
            "attention_mask": _zoo.padding_mask(batch, seq),
        }

    source = load_model_file(ZOO / f"{name}.py")
    model = source.build_model()
    seq = {1: ("seq", 2, 64)}
    traced = trace_model(
        model, call(2, 16), dynamic_dims={"input_ids": seq, "attention_mask": seq}, progress=False
    )
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=1)
    manifest = write_build_dir(traced, plan, tmp_path, source, batch_size=2, microbatches=1)
    files = [tmp_path / s.source for s in manifest.stages]
    texts = [f.read_text() for f in files] + [
        (tmp_path / manifest.shared_source).read_text() if manifest.shared_source else ""
    ]
    masks = [
        _function_lines(t, "create_causal_mask") for t in texts if "def create_causal_mask(" in t
    ]
    assert len(masks) == 1, "the mask function is written once"
    assert len(masks[0]) <= MAX_MASK_LINES, "\n".join(masks[0])
    pipe = load_pipeline(tmp_path)
    for length in (8, 24):
        kwargs = call(3, length)
        for training in (True, False):
            result = compare_in_mode(
                model, pipe, list(pipe.stages), lambda m: m(**kwargs), training=training
            )
            assert result.ok, (name, length, training, result.worst)
