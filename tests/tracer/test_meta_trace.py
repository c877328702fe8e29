"""Tracing on the meta device: the profile equals the real-tensor analytic one, and nothing real is allocated."""

from __future__ import annotations

import math
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from example_models import EXAMPLES
from fxpipe.errors import TraceError
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model, trace_model_file
from fxpipe.tracer.measure.meta import SKIPPED_ON_META, build_on_meta, is_meta_model

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"


def _trace(path: Path, **options):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_model_file(load_model_file(path), batch_size=2, progress=False, **options)


def assert_same_profile(real, meta) -> None:
    """Units, edges and figures equal; times within 1% (Note [meta tracing])."""
    assert [u.name for u in real.units] == [u.name for u in meta.units]
    assert real.edges == meta.edges
    assert (real.param_sizes, real.param_shapes, real.ties, real.inputs) == (
        meta.param_sizes,
        meta.param_shapes,
        meta.ties,
        meta.inputs,
    )
    for a, b in zip(real.units, meta.units):
        assert (
            a.fwd_flops,
            a.param_bytes,
            a.buffer_bytes,
            a.activation_bytes,
            a.outputs,
            a.params,
            a.weight_grad_fraction,
        ) == (
            b.fwd_flops,
            b.param_bytes,
            b.buffer_bytes,
            b.activation_bytes,
            b.outputs,
            b.params,
            b.weight_grad_fraction,
        ), a.name
        assert math.isclose(a.fwd_ms, b.fwd_ms, rel_tol=0.01) and math.isclose(
            a.bwd_ms, b.bwd_ms, rel_tol=0.01
        ), a.name
    assert not real.meta and meta.meta
    assert meta.skipped_checks == SKIPPED_ON_META and not real.skipped_checks
    assert meta.trace_device == real.trace_device == "cpu"  # the cost device prices both


@pytest.mark.parametrize("name", ["gpt", "mlp", "branchy"])
def test_meta_profile_equals_real_on_examples(name):
    real = _trace(EXAMPLES[name])
    meta = _trace(EXAMPLES[name], trace_device="meta")
    assert all(p.is_meta for p in meta.model.parameters())
    assert_same_profile(real.profile, meta.profile)
    assert meta.graph_module.code == real.graph_module.code


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert_mlm", "resnet", "vit_mha", "t5"])
def test_meta_profile_equals_real_on_zoo(name):
    real = _trace(ZOO / f"{name}.py")
    meta = _trace(ZOO / f"{name}.py", trace_device="meta")
    assert_same_profile(real.profile, meta.profile)


def test_attention_kernel_as_the_cpu_picks_it():
    """SDPA decomposes into bmm on meta but runs flash attention on the CPU: counted as on the CPU."""
    from fxpipe.tracer.measure.counting import OpCounter
    from fxpipe.tracer.measure.meta import CpuKernelChoice

    counts = {}
    for device in ("cpu", "meta"):
        q = torch.randn(2, 4, 16, 8, device=device, requires_grad=True)
        k = torch.randn(2, 2, 16, 8, device=device, requires_grad=True)
        mask = torch.ones(16, 16, dtype=torch.bool, device=device).tril()
        ops = OpCounter()
        with CpuKernelChoice(), ops:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, k, attn_mask=mask, enable_gqa=True
            )
        counts[device] = ops.items()
    assert counts["meta"] == counts["cpu"]
    assert "_scaled_dot_product_flash_attention_for_cpu" in dict(counts["cpu"])


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_model_file_that_builds_on_meta_is_detected(tmp_path):
    """A factory that builds a model far larger than this machine on meta traces in seconds, with no real tensor."""
    path = _write(
        tmp_path,
        """
        import torch
        import torch.nn as nn

        WIDTH = 65536  # each Linear holds 16 GiB of fp32 weights

        def build_model():
            with torch.device("meta"):
                return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))

        def example_inputs(batch_size):
            return (torch.randn(batch_size, WIDTH),)
    """,
    )
    traced = _trace(path)
    profile = traced.profile
    assert profile.meta and profile.trace_device == "cpu"
    assert profile.total_param_bytes == 2 * (65536 * 65536 + 65536) * 4
    assert sum(u.fwd_flops for u in profile.units) == 2 * 2 * (2 * 65536 * 65536)
    assert is_meta_model(traced.model)


def test_measuring_on_meta_is_refused():
    with pytest.raises(TraceError, match="--measure-times runs real kernels"):
        _trace(EXAMPLES["mlp"], trace_device="meta", measure_times=True)
    with pytest.raises(TraceError, match="--measure-memory runs real kernels"):
        _trace(EXAMPLES["mlp"], trace_device="meta", measure_memory=True)


def test_real_model_on_meta_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(TraceError, match="needs a model built on the meta device"):
        trace_model(model, (torch.randn(2, 4),), trace_device="meta", progress=False)
    assert not any(p.is_meta for p in model.parameters())  # left as it was


def test_cost_device_prices_a_meta_trace():
    model = build_on_meta(
        lambda: nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8))
    )
    x = torch.randn(64, 8192)
    cpu = trace_model(model, (x,), trace_device="meta", progress=False).profile
    cuda = trace_model(model, (x,), trace_device="meta", cost_device="cuda", progress=False).profile
    assert cuda.trace_device == "cuda" and cpu.trace_device == "cpu"
    assert sum(u.fwd_ms for u in cuda.units) < sum(u.fwd_ms for u in cpu.units)
    with pytest.raises(TraceError, match="cost_device 'tpu'"):
        trace_model(model, (x,), trace_device="meta", cost_device="tpu", progress=False)


def test_mixtral_on_meta_names_the_op_and_the_module():
    """Mixtral's experts call torch._grouped_mm, whose meta kernel refuses float32: one line naming both."""
    pytest.importorskip("transformers")
    with pytest.raises(TraceError) as info:
        _trace(ZOO / "mixtral.py", trace_device="meta")
    message = str(info.value)
    assert "\n" not in message
    assert (
        "aten._grouped_mm" in message and "model.layers.0.mlp.experts (MixtralExperts)" in message
    )
    assert "trace with real tensors (--device cpu" in message
    assert _trace(ZOO / "mixtral.py", trace_device="cpu").profile.units  # on real tensors it plans


def test_data_dependent_routing_on_meta_names_the_op_and_the_module(tmp_path):
    path = _write(
        tmp_path,
        """
        import torch
        import torch.nn as nn

        class Router(nn.Module):
            def forward(self, x):
                picked = torch.nonzero(x[:, 0] > 0).flatten()  # how many rows: known only from the values
                return x.index_add(0, picked, x[picked])

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(4, 4)
                self.router = Router()

            def forward(self, x):
                return self.router(self.proj(x))

        def build_model():
            return Model()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 4),)
    """,
    )
    with pytest.raises(
        TraceError,
        match=r"on the meta device, aten\.nonzero\.default in router \(Router\) cannot "
        r"run .*trace with real tensors \(--device cpu",
    ):
        _trace(path, trace_device="meta")
