"""The traced call (fxpipe.tracer.call): the model-file contract's three forms, binding to the forward
signature, constants, and tracing keyword inputs and used defaults with both front ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen import load_pipeline, read_manifest, write_build_dir
from fxpipe.errors import CallError, ModelFileError, TraceError
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model, trace_model_file
from fxpipe.tracer.call import CallSpec, Constant, ModelInputs, bind_example, parse_model_inputs


class Masked(nn.Module):
    """HF-shaped: the mask comes after an argument a positional call cannot skip; defaults the graph uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(
        self,
        x: torch.Tensor,
        past: Any = None,
        mask: torch.Tensor | None = None,
        scale: float = 1.0,
        *,
        attn_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> Any:
        h = self.a(x)
        if past is not None:
            h = h + past
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        h = F.scaled_dot_product_attention(
            h, h, h, attn_mask=attn_mask
        )  # the graph uses the None default
        logits = self.head(self.b(h) * scale)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if not return_dict:
            return logits
        return {"logits": logits, "loss": loss} if loss is not None else {"logits": logits}


def _x(b: int) -> torch.Tensor:
    return torch.randn(b, 5, 6, generator=torch.Generator().manual_seed(b))


def _mask(b: int) -> torch.Tensor:
    mask = torch.ones(b, 5)
    mask[-1, 3:] = 0
    return mask


def _labels(b: int) -> torch.Tensor:
    return torch.randint(0, 3, (b, 5), generator=torch.Generator().manual_seed(7))


# ---- the contract's forms ---------------------------------------------------------------------------------------


def test_parse_accepts_a_tensor_tuple_dict_and_args_kwargs_pair() -> None:
    x, m = _x(2), _mask(2)
    assert parse_model_inputs(x) == ModelInputs((x,))
    assert parse_model_inputs((x, None, m)) == ModelInputs((x, None, m))
    assert parse_model_inputs([x, m]) == ModelInputs((x, m))
    assert parse_model_inputs({"x": x, "mask": m}) == ModelInputs((), {"x": x, "mask": m})
    assert parse_model_inputs(((x,), {"mask": m, "scale": 2.0})) == ModelInputs(
        (x,), {"mask": m, "scale": 2.0}
    )
    call = ModelInputs((x,), {"return_dict": False})
    assert parse_model_inputs(call) is call
    # containers of tensors (Note [tensors inside containers])
    assert parse_model_inputs(({"image": x, "n": 2}, [x, m])) == ModelInputs(
        ({"image": x, "n": 2}, [x, m])
    )


@pytest.mark.parametrize(
    "value, match",
    [
        (3, "got int 3; return a tuple of positional arguments, a dict of keyword arguments or an"),
        (
            (torch.zeros(2), nn.Linear(2, 2)),
            "argument 1 is a Linear; the inputs may be tensors and plain constants",
        ),
        (
            {"past": (torch.zeros(2), nn.Linear(2, 2)), "x": torch.zeros(2)},
            r"argument 'past'\[1\] is a Linear; the inputs may hold tensors and plain constants",
        ),
        ({"x": None, "flag": True}, r"no argument is a tensor \(x=None, flag=True\)"),
        ({1: torch.zeros(2)}, "keyword argument names must be strings"),
    ],
)
def test_parse_refuses_what_cannot_be_traced(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_model_inputs(value)


def test_model_file_example_inputs_in_each_form(tmp_path: Path) -> None:
    path = tmp_path / "forms.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(3, 3)\n"
        "def as_tuple(b):\n    return (torch.ones(b, 3),)\n"
        "def as_dict(b):\n    return {'input': torch.ones(b, 3)}\n"
        "def as_pair(b):\n    return (), {'input': torch.ones(b, 3)}\n"
        "def as_object(b):\n    return object()\n"
    )
    for fn, kwargs in (("as_tuple", False), ("as_dict", True), ("as_pair", True)):
        source = load_model_file(path, inputs_fn=fn)
        call = source.example_call(4)
        assert bool(call.kwargs) == kwargs and call(source.build_model()).shape == (4, 3)
        traced = trace_model_file(source, 2, progress=False)
        assert traced.call is not None and traced.call.inputs == ("input",)
    with pytest.raises(
        ModelFileError, match=r"forms.py:as_object\(4\): got object <object.*; return a tuple"
    ):
        load_model_file(path, inputs_fn="as_object").example_call(4)
    with pytest.raises(
        ModelFileError, match="passes keyword arguments .input.; use ModelSource.example_call"
    ):
        load_model_file(path, inputs_fn="as_dict").example_inputs(4)


# ---- binding to the signature, and later calls -------------------------------------------------------------------


def test_binding_orders_tensor_inputs_by_the_signature_and_records_every_other_argument() -> None:
    x, m = _x(2), _mask(2)
    call = bind_example(
        Masked(), parse_model_inputs({"mask": m, "x": x, "return_dict": True, "scale": 0.5})
    )
    assert call.spec.parameters == ("x", "past", "mask", "scale")
    assert call.spec.inputs == ("x", "mask") and call.tensors == (x, m)
    constants = {c.name: (c.value, c.default) for c in call.spec.constants}
    assert constants == {
        "past": (None, True),
        "scale": (0.5, False),
        "attn_mask": (None, True),
        "labels": (None, True),
        "return_dict": (True, True),
    }
    assert call.concrete == {
        "past": None,
        "scale": 0.5,
        "attn_mask": None,
        "labels": None,
        "return_dict": True,
    }
    assert call.symbolic
    with pytest.raises(
        ValueError, match=r"do not fit Masked.forward\(x.*unexpected keyword argument 'bogus'"
    ):
        bind_example(Masked(), ModelInputs((x,), {"bogus": m}))


def test_a_call_binds_like_the_original_forward_and_refuses_other_constants() -> None:
    spec = bind_example(
        Masked(), parse_model_inputs({"x": _x(2), "mask": _mask(2), "scale": 0.5})
    ).spec
    x, m = _x(3), _mask(3)
    for args, kwargs in [
        ((x, None, m, 0.5), {}),
        ((x,), {"mask": m, "scale": 0.5}),
        ((), {"scale": 0.5, "mask": m, "x": x, "return_dict": True, "past": None}),
    ]:
        got = spec.bind(args, kwargs)
        assert got[0] is x and got[1] is m
    cases = [
        (((x,), {"scale": 0.5}), "traced with a tensor for 'mask', but this call does not pass it"),
        (
            ((x, m), {"scale": 0.5}),
            r"past=a float32\[3, 5\] tensor differs from the value .* \(past=None\)",
        ),
        (
            ((x,), {"mask": m, "scale": 2.0}),
            r"scale=2.0 differs from the value the model was traced with \(scale=0.5\)",
        ),
        (((x,), {"mask": m}), r"traced with scale=0.5, but this call leaves 'scale' out"),
        (((x,), {"mask": m, "scale": 0.5, "return_dict": False}), "return_dict=False differs"),
        (((x,), {"mask": m, "scale": 0.5, "labels": m}), "labels=a float32.* tensor differs"),
        (
            ((x,), {"mask": m, "scale": 0.5, "extra": 1}),
            r"traced without the arguments \['extra'\]",
        ),
        (((x,), {"x": x, "mask": m, "scale": 0.5}), "multiple values for argument 'x'"),
        (((x, None, m, 0.5, 1), {}), "takes 4 positional arguments"),
    ]
    for (args, kwargs), match in cases:
        with pytest.raises(CallError, match=match):
            spec.bind(args, kwargs)
    assert issubclass(CallError, TypeError)  # a wrong call is a TypeError, as in Python
    assert spec.bind_any(spec.call_of((x, m))) == (x, m)


def test_constants_compare_by_type_and_objects_by_repr() -> None:
    assert Constant.of("flag", True, False).matches(True)
    assert not Constant.of("flag", True, False).matches(1)
    assert Constant.of("sizes", (2, 3), False).matches([2, 3])
    dtype = Constant.of("dtype", torch.float16, True)
    assert not dtype.literal and dtype.matches(torch.float16) and not dtype.matches(torch.float32)


# ---- tracing keyword inputs and used defaults (issue 10 items 3 and 7) ---------------------------------------------


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("form", ["positional", "dict", "pair"])
def test_keyword_inputs_trace_to_named_placeholders_on_both_front_ends(
    frontend: str, form: str
) -> None:
    model = Masked()
    inputs = {
        "positional": (_x(2),),
        "dict": {"x": _x(2), "mask": _mask(2), "labels": _labels(2)},
        "pair": ((_x(2),), {"mask": _mask(2), "return_dict": False}),
    }[form]
    traced = trace_model(model, inputs, frontend=frontend, progress=False)
    names = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    assert traced.call is not None and tuple(names) == traced.call.inputs
    assert (
        traced.call.inputs
        == {"positional": ("x",), "dict": ("x", "mask", "labels"), "pair": ("x", "mask")}[form]
    )
    want = parse_model_inputs(inputs)(model)
    got = traced.unflatten_output(traced.graph_module(*traced.example_inputs))
    torch.testing.assert_close(got, want)


class Block(nn.Module):
    """A timm ``Block``: ``forward(x, attn_mask=None)``, the mask reaches SDPA (issue 10, item 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.qkv(x)
        return F.scaled_dot_product_attention(
            h[..., :4], h[..., 4:8], h[..., 8:], attn_mask=attn_mask
        )


class WithExtra(Block):
    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, **extra: Any
    ) -> torch.Tensor:
        out = super().forward(x, attn_mask) * extra["scale"]
        return out + extra["bias"] if "bias" in extra else out


def test_a_used_default_needs_no_example_input_and_var_keywords_need_export() -> None:
    x = torch.randn(2, 3, 4)
    for frontend in ("symbolic", "export"):
        traced = trace_model(Block(), (x,), frontend=frontend, progress=False)
        assert traced.call.inputs == ("x",) and traced.call.constants == (
            Constant("attn_mask", None, True, True),
        )
    # a constant through **kwargs (transformers 5 takes return_dict=, output_hidden_states= so)
    inputs = {"x": x, "scale": 3.0}
    traced = trace_model(WithExtra(), inputs, progress=False)
    assert traced.frontend == "export" and traced.call.inputs == ("x",)
    assert traced.call.constants[-1] == Constant("scale", 3.0)
    torch.testing.assert_close(
        traced.graph_module(torch.cat([x, x]))[0], traced.model(torch.cat([x, x]), scale=3.0)
    )
    assert not hasattr(traced.model, "forward") or "forward" not in vars(traced.model)
    with pytest.raises(TraceError, match="arguments passed through \\*args or \\*\\*kwargs"):
        trace_model(WithExtra(), inputs, frontend="symbolic", progress=False)
    with pytest.raises(
        TraceError, match=r"tensors passed through \*\*extra \(bias\).*named parameters"
    ):
        trace_model(
            WithExtra(), {**inputs, "bias": torch.ones(2, 3, 4)}, frontend="export", progress=False
        )


def test_batch_dims_of_keyword_inputs_come_from_the_model_file(tmp_path: Path) -> None:
    path = tmp_path / "seqfirst.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x, bias=None, *, table):\n        return self.lin(x) + table[: x.shape[0]].unsqueeze(1)\n"
        "def build_model():\n    return M()\n"
        "def example_inputs(b):\n    return {'table': torch.ones(10, 4), 'x': torch.ones(5, b, 4)}\n"
        "def changing(b):\n    return {'x': torch.ones(5, b, 4), 'table': torch.ones(10, 4), 'bias': b}\n"
    )
    traced = trace_model_file(load_model_file(path), 2, frontend="export", progress=False)
    assert traced.call.inputs == ("x", "table")
    assert [s.batch_dim for s in traced.profile.inputs] == [1, None]
    with pytest.raises(
        ModelFileError,
        match=r"changing\(2\) and seqfirst.py:changing\(4\) pass different arguments",
    ):
        trace_model_file(load_model_file(path, inputs_fn="changing"), 2, progress=False)


# ---- a build called like the original ------------------------------------------------------------------------------


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_pipeline_takes_keywords_and_checks_the_traced_constants(
    tmp_path: Path, frontend: str
) -> None:
    torch.manual_seed(0)
    model = Masked()
    inputs = {"x": _x(4), "mask": _mask(4), "labels": _labels(4), "scale": 0.5}
    traced = trace_model(model, inputs, frontend=frontend, progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=1)
    write_build_dir(traced, plan, tmp_path / "b", None, batch_size=4, microbatches=1)
    manifest = read_manifest(tmp_path / "b")
    assert manifest.call == traced.call and [t.name for t in manifest.inputs] == [
        "x",
        "mask",
        "labels",
    ]
    pipeline = load_pipeline(tmp_path / "b")
    want = model(**inputs)
    for got in (pipeline(**inputs), pipeline(_x(4), None, _mask(4), 0.5, labels=_labels(4))):
        assert set(got) == {"logits", "loss"}
        torch.testing.assert_close(got, want)
    got["loss"].backward()
    want["loss"].backward()
    for stage in pipeline.stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, model.get_parameter(name).grad)
    with pytest.raises(CallError, match=r"scale=1.0 differs .*\(scale=0.5\)"):
        pipeline(**{**inputs, "scale": 1.0})
    with pytest.raises(CallError, match="traced with a tensor for 'labels'"):
        pipeline(_x(4), mask=_mask(4), scale=0.5)
