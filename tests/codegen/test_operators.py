"""Every aten rewrite computes exactly what the aten op computes (Note [exact operator rewrites]).

For each rule: a one-node graph calling the aten overload is rewritten and rendered to
Python source as a stage would be; the rendered function and the aten op get the same
random inputs and must agree bit for bit in outputs, in-place effects, aliasing and
gradients, and a pre-dispatch trace of the rendered call must record the same aten op.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fxpipe.codegen.render.forward import render_forward
from fxpipe.codegen.render.operators import RULES, rewrite_aten, rewrite_call
from fxpipe.codegen.render.pyrender import ImportTable

aten = torch.ops.aten
MAX = 9223372036854775807
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def r(*shape: int, positive: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, dtype=torch.float64)
    return t.abs() + 0.5 if positive else t


def i(*shape: int, high: int = 4) -> torch.Tensor:
    return torch.randint(0, high, shape)


def b(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) > 0.5


Case = Callable[[], tuple[tuple, dict]]
X: Case = lambda: ((r(2, 3),), {})  # noqa: E731
CASES: dict[str, Case] = {
    "add.Tensor": lambda: ((r(2, 3), r(2, 3)), {}),
    "sub.Tensor": lambda: ((r(2, 3), 1.5), {}),
    "mul.Tensor": lambda: ((r(2, 3), r(3)), {}),
    "div.Tensor": lambda: ((r(2, 3), r(2, 3, positive=True)), {}),
    "matmul.default": lambda: ((r(2, 3, 4), r(4, 5)), {}),
    "pow.Tensor_Scalar": lambda: ((r(2, 3), 3.0), {}),
    "pow.Tensor_Tensor": lambda: ((r(2, 3, positive=True), r(2, 3)), {}),
    "remainder.Tensor": lambda: ((r(2, 3), r(2, 3, positive=True)), {}),
    "remainder.Scalar": lambda: ((r(2, 3), 0.7), {}),
    "floor_divide.default": lambda: ((r(2, 3), r(2, 3, positive=True)), {}),
    "eq.Tensor": lambda: ((i(2, 3), i(2, 3)), {}),
    "eq.Scalar": lambda: ((i(2, 3), 1), {}),
    "ne.Tensor": lambda: ((i(2, 3), i(2, 3)), {}),
    "ne.Scalar": lambda: ((i(2, 3), 1), {}),
    "lt.Tensor": lambda: ((r(2, 3), r(2, 3)), {}),
    "lt.Scalar": lambda: ((r(2, 3), 0.1), {}),
    "le.Tensor": lambda: ((i(2, 3), i(2, 3)), {}),
    "le.Scalar": lambda: ((i(2, 3), 2), {}),
    "gt.Tensor": lambda: ((r(2, 3), r(2, 3)), {}),
    "gt.Scalar": lambda: ((r(2, 3), 0.0), {}),
    "ge.Tensor": lambda: ((i(2, 3), i(2, 3)), {}),
    "ge.Scalar": lambda: ((i(2, 3), 0), {}),
    "__and__.Tensor": lambda: ((b(2, 3), b(2, 3)), {}),
    "__and__.Scalar": lambda: ((i(2, 3), 1), {}),
    "__or__.Tensor": lambda: ((b(2, 3), b(2, 3)), {}),
    "__or__.Scalar": lambda: ((i(2, 3), 2), {}),
    "__xor__.Tensor": lambda: ((b(2, 3), b(2, 3)), {}),
    "__xor__.Scalar": lambda: ((i(2, 3), 3), {}),
    "neg.default": X,
    "bitwise_not.default": lambda: ((b(2, 3),), {}),
    "rsub.Scalar": lambda: ((r(2, 3), 1.0), {}),
    "view.default": lambda: ((r(2, 6), [-1, 3]), {}),
    "view.dtype": lambda: ((r(2, 3), torch.int64), {}),
    "reshape.default": lambda: ((r(2, 3, 4).transpose(0, 1), [6, 4]), {}),
    "transpose.int": lambda: ((r(2, 3, 4), 1, 2), {}),
    "permute.default": lambda: ((r(2, 3, 4), [2, 0, 1]), {}),
    "unsqueeze.default": lambda: ((r(2, 3), 1), {}),
    "squeeze.dim": lambda: ((r(2, 1, 3), 1), {}),
    "squeeze.dims": lambda: ((r(2, 1, 3, 1), [1, 3]), {}),
    "squeeze.default": lambda: ((r(1, 3, 1),), {}),
    "flatten.using_ints": lambda: ((r(2, 3, 4), 1, 2), {}),
    "split.Tensor": lambda: ((r(2, 6), 2, 1), {}),
    "split_with_sizes.default": lambda: ((r(2, 6), [1, 5], 1), {}),
    "chunk.default": lambda: ((r(6, 2), 3), {}),
    "unbind.int": lambda: ((r(2, 3), 1), {}),
    "type_as.default": lambda: ((r(2, 3), torch.zeros(1, dtype=torch.float32)), {}),
    "masked_fill.Scalar": lambda: ((r(2, 3), b(2, 3), float("-inf")), {}),
    "masked_fill.Tensor": lambda: ((r(2, 3), b(2, 3), torch.tensor(2.0, dtype=torch.float64)), {}),
    "new_ones.default": lambda: ((r(2, 3), [4]), {"dtype": torch.bool, "pin_memory": False}),
    "new_zeros.default": lambda: ((r(2, 3), [4, 2]), {}),
    "new_full.default": lambda: ((r(2, 3), [2], 7.0), {}),
    "new_empty.default": lambda: ((r(2, 3), [5]), {}),
    "copy_.default": lambda: ((r(2, 3), r(2, 3)), {}),
    "clone.default": X,
    "detach.default": X,
    "repeat.default": lambda: ((r(2, 3), [2, 1, 2]), {}),
    "expand_as.default": lambda: ((r(1, 3), r(4, 3)), {}),
    "view_as.default": lambda: ((r(2, 3), r(3, 2)), {}),
    "to.dtype": lambda: ((r(2, 3), torch.float32), {}),
    "to.device": lambda: ((r(2, 3), torch.device("cpu"), torch.float16), {}),
    "to.dtype_layout": lambda: (
        (r(2, 3),),
        {"dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu")},
    ),
    "add_.Tensor": lambda: ((r(2, 3), r(2, 3)), {}),
    "mul_.Tensor": lambda: ((r(2, 3), 2.0), {}),
    "zero_.default": X,
    "fill_.Scalar": lambda: ((r(2, 3), 3.0), {}),
    "masked_fill_.Scalar": lambda: ((r(2, 3), b(2, 3), 0.5), {}),
    "sym_size.int": lambda: ((r(2, 3), 1), {}),
    "sym_numel.default": X,
    "sym_stride.int": lambda: ((r(2, 3), 0), {}),
    "item.default": lambda: ((r(()),), {}),
    "contiguous.default": lambda: ((r(3, 2).t(),), {}),
    "expand.default": lambda: ((r(1, 3), [4, -1]), {}),
    "tanh.default": X,
    "sigmoid.default": X,
    "exp.default": X,
    "log.default": lambda: ((r(2, 3, positive=True),), {}),
    "sqrt.default": lambda: ((r(2, 3, positive=True),), {}),
    "rsqrt.default": lambda: ((r(2, 3, positive=True),), {}),
    "abs.default": X,
    "sin.default": X,
    "cos.default": X,
    "erf.default": X,
    "relu.default": X,
    "cumsum.default": lambda: ((r(2, 3), -1), {}),
    "diff.default": lambda: ((r(2, 5), 1, -1, r(2, 1)), {}),
    "addmm.default": lambda: ((r(4), r(2, 3), r(3, 4)), {}),
    "bmm.default": lambda: ((r(2, 3, 4), r(2, 4, 5)), {}),
    "mm.default": lambda: ((r(2, 3), r(3, 4)), {}),
    "baddbmm.default": lambda: ((r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)), {"alpha": 0.5}),
    "cat.default": lambda: (([r(2, 3), r(2, 2)], 1), {}),
    "stack.default": lambda: (([r(2, 3), r(2, 3)], 0), {}),
    "where.self": lambda: ((b(2, 3), r(2, 3), r(2, 3)), {}),
    "softmax.int": lambda: ((r(2, 3), -1), {}),
    "log_softmax.int": lambda: ((r(2, 3), 1), {}),
    "arange.default": lambda: ((5,), {"device": torch.device("cpu"), "pin_memory": False}),
    "arange.start": lambda: ((1, 6), {"dtype": torch.float64}),
    "arange.start_step": lambda: ((0, 10, 3), {}),
    "full.default": lambda: (([2, 3], 1.5), {"dtype": torch.float64}),
    "zeros.default": lambda: (([2, 3],), {}),
    "ones.default": lambda: (([3],), {"dtype": torch.int64}),
    "zeros_like.default": X,
    "ones_like.default": X,
    "full_like.default": lambda: ((r(2, 3), 4.0), {}),
    "gather.default": lambda: ((r(2, 3), 1, i(2, 3, high=3)), {}),
    "index_select.default": lambda: ((r(4, 3), 0, i(5, high=4)), {}),
    "mean.dim": lambda: ((r(2, 3), [1], True), {}),
    "mean.default": X,
    "sum.dim_IntList": lambda: ((r(2, 3, 4), [0, 2]), {}),
    "sum.default": X,
    "amax.default": lambda: ((r(2, 3), [1]), {}),
    "amin.default": lambda: ((r(2, 3), [0]), {}),
    "clamp.default": lambda: ((r(2, 3), -0.5, 0.5), {}),
    "tril.default": lambda: ((r(3, 3),), {}),
    "triu.default": lambda: ((r(3, 3), 1), {}),
    "maximum.default": lambda: ((r(2, 3), r(2, 3)), {}),
    "minimum.default": lambda: ((r(2, 3), r(2, 3)), {}),
    "logical_not.default": lambda: ((b(2, 3),), {}),
    "logical_and.default": lambda: ((b(2, 3), b(2, 3)), {}),
    "logical_or.default": lambda: ((b(2, 3), b(2, 3)), {}),
    "flip.default": lambda: ((r(2, 3), [1]), {}),
    "roll.default": lambda: ((r(2, 3), [1], [1]), {}),
    "argmax.default": lambda: ((r(2, 3), 1), {}),
    "max.dim": lambda: ((r(2, 3), 1), {}),
    "min.dim": lambda: ((r(2, 3), 0, True), {}),
    "batch_norm.default": lambda: (
        (r(4, 3), r(3), r(3), r(3), r(3, positive=True), True, 0.1, 1e-5, False),
        {},
    ),
    "group_norm.default": lambda: ((r(2, 4, 3), 2, r(4), r(4), 1e-5, False), {}),
    "conv1d.default": lambda: ((r(2, 3, 8), r(4, 3, 3), r(4), [2], [1]), {}),
    "conv2d.default": lambda: ((r(2, 3, 6, 6), r(4, 3, 3, 3), None, [1, 1], [1, 1]), {}),
    "max_pool2d.default": lambda: ((r(2, 3, 6, 6), [2, 2], [2, 2]), {}),
    "isnan.default": X,
    "linear.default": lambda: ((r(2, 3), r(4, 3), r(4)), {}),
    "dropout.default": lambda: ((r(4, 5), 0.5, True), {}),
    "scaled_dot_product_attention.default": lambda: (
        (r(2, 2, 4, 8), r(2, 2, 4, 8), r(2, 2, 4, 8), b(2, 1, 4, 4)),
        {"scale": 0.25},
    ),
    "gelu.default": lambda: ((r(2, 3),), {"approximate": "tanh"}),
    "silu.default": X,
    "adaptive_avg_pool2d.default": lambda: ((r(2, 3, 6, 6), [2, 2]), {}),
    "layer_norm.default": lambda: ((r(2, 3, 4), [4], r(4), r(4), 1e-5, False), {}),
    "embedding.default": lambda: ((r(6, 3), i(2, 4, high=6), 0), {}),
    "slice.Tensor": lambda: ((r(3, 5, 4), 1, 1, MAX), {}),
    "select.int": lambda: ((r(3, 5), 1, -2), {}),
    "alias.default": X,
    "index.Tensor": lambda: ((r(4, 5), [i(2, 3, high=4), i(3, high=5)]), {}),
}
# Numerically equal, and recorded as these ops instead (see Note [exact operator rewrites])
SAME_RESULT_OTHER_OP = {"to.dtype_layout": ["aten.to.device"]}
UNINITIALIZED = {"new_empty.default"}
IN_PLACE = {
    "copy_.default",
    "add_.Tensor",
    "mul_.Tensor",
    "zero_.default",
    "fill_.Scalar",
    "masked_fill_.Scalar",
}
NO_GRAD = IN_PLACE | {"floor_divide.default"}  # in-place on a leaf, or no derivative
CONSTANT_INPUTS = {"batch_norm.default": {3, 4}}  # running statistics never require grad


def _graph(op: Any, args: tuple, kwargs: dict) -> tuple[fx.Graph, list[Any]]:
    """A graph calling ``op``: every tensor (also inside lists) becomes a placeholder with its value as meta."""
    g = fx.Graph()
    inputs: list[Any] = []

    def lift(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            ph = g.placeholder(f"t{len(inputs)}")
            ph.meta["val"] = a
            inputs.append(a)
            return ph
        if isinstance(a, list):
            return [lift(x) for x in a]
        return a

    node = g.call_function(
        op, tuple(lift(a) for a in args), {k: lift(v) for k, v in kwargs.items()}
    )
    g.output(node)
    return g, inputs


def _on(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, torch.device):
        return torch.device(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value


def _compile(g: fx.Graph) -> Callable[..., Any]:
    imports = ImportTable()
    lines = render_forward(g, imports, lambda target: f"self.{target}")
    source = "\n".join(imports.lines() + lines)
    namespace: dict[str, Any] = {}
    exec(compile(source, "<rewritten>", "exec"), namespace)  # noqa: S102 - our own rendered source
    forward = namespace["forward"]
    return lambda *a: forward(None, *a)


def _leaves(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _run(
    fn: Callable[..., Any], inputs: list[Any], grad: bool, constant: set[int]
) -> tuple[list[Any], list[Any], list[Any]]:
    xs = [
        x.detach().clone().requires_grad_(grad and x.is_floating_point() and k not in constant)
        for k, x in enumerate(inputs)
    ]
    torch.manual_seed(0)
    out = _leaves(fn(*xs))
    grads: list[Any] = []
    floats = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
    if floats:
        torch.manual_seed(1)
        loss = sum((o * torch.randn_like(o)).sum() for o in floats)
        grads = list(
            torch.autograd.grad(loss, [x for x in xs if x.requires_grad], allow_unused=True)
        )
    return out, xs, grads


def _ops(fn: Callable[..., Any], inputs: list[Any]) -> list[str]:
    traced = make_fx(fn, pre_dispatch=True)(*[x.clone() for x in inputs])
    return [
        str(n.target)
        for n in traced.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    ]


def _equal(a: Any, b: Any, key: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, key
        if key not in UNINITIALIZED:
            assert torch.equal(a, b) or (
                a.is_floating_point()
                and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(), b.nan_to_num())
            ), key
    else:
        assert a == b, key


def test_every_rule_has_a_case() -> None:
    assert sorted(CASES) == sorted(RULES)


@pytest.fixture
def deterministic_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN may pick a different (atomics-based) backward algorithm for each of two identical
    convolutions; the comparison is bitwise, so ask for deterministic kernels."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key", sorted(CASES))
def test_rewrite_is_exact(key: str, device: str, deterministic_kernels: None) -> None:
    torch.manual_seed(sum(map(ord, key)))
    name, overload = key.split(".")
    op = getattr(getattr(aten, name), overload)
    args, kwargs = _on(CASES[key](), device)
    g, inputs = _graph(op, args, kwargs)
    assert rewrite_call(next(n for n in g.nodes if n.op == "call_function")) is not None, (
        f"{key} was not rewritten"
    )
    reference = fx.GraphModule(torch.nn.Module(), g)
    rewritten = fx.Graph()
    rewritten.output(rewritten.graph_copy(g, {}))
    rewrite_aten(rewritten)
    assert not any(isinstance(n.target, torch._ops.OpOverload) for n in rewritten.nodes), key
    fn = _compile(rewritten)

    grad, constant = key not in NO_GRAD, CONSTANT_INPUTS.get(key, set())
    want, want_in, want_grads = _run(reference, inputs, grad, constant)
    got, got_in, got_grads = _run(fn, inputs, grad, constant)
    assert len(want) == len(got), key
    for w, o in zip(want, got):
        _equal(w, o, key)
    for w, o in zip(want_in, got_in):  # in-place effects on the inputs
        _equal(w.detach(), o.detach(), key)
    for w, o in zip(want_grads, got_grads):
        assert (w is None) == (o is None), key
        if w is not None:
            assert torch.equal(w, o), f"gradient of {key}"
    for w, o, wi, oi in [
        (w, o, want_in, got_in) for w, o in zip(want, got) if isinstance(w, torch.Tensor)
    ]:
        aliases_w = [x.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for x in wi]
        aliases_o = [x.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for x in oi]
        assert aliases_w == aliases_o, f"{key}: a view must stay a view and a copy a copy"
    if (
        key not in ("item.default", "sym_size.int", "sym_numel.default", "sym_stride.int")
        and device == "cpu"
    ):
        expected = SAME_RESULT_OTHER_OP.get(key, _ops(reference, inputs))
        assert _ops(fn, inputs) == expected, key


def test_layer_norm_ignores_cudnn_enable() -> None:
    x, w, bias = r(2, 3, 4), r(4), r(4)
    a = aten.layer_norm.default(x, [4], w, bias, 1e-5, False)
    assert torch.equal(a, aten.layer_norm.default(x, [4], w, bias, 1e-5, True))
    assert torch.equal(a, F.layer_norm(x, [4], w, bias, 1e-5))


def test_what_has_no_exact_spelling_stays_aten() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = r(2, 3)
    keep = [
        g.call_function(aten.add.Tensor, (x, x), {"alpha": 2}),  # `+` has no alpha
        g.call_function(aten.expand.default, (x, [2, 3]), {"implicit": True}),
        g.call_function(aten.to.dtype_layout, (x,), {"layout": torch.sparse_coo}),
        g.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float64}),
        g.call_function(
            aten.index.Tensor, (x, [None, x])
        ),  # a None index is `:` in aten, a new dim in Python
        g.call_function(aten.embedding.default, (x, x, -2)),
    ]
    g.output(tuple(keep))
    rewrite_aten(g)
    assert [n.target for n in g.nodes if n.op == "call_function"] == [n.target for n in keep]
