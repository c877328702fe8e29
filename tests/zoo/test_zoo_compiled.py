"""Zoo models cut in 2 stages, each stage compiled, equal the original model in train and eval mode (issue 39).

Each model is traced and partitioned as ``fxpipe partition --stages 2`` does; each loaded stage is
compiled as a zero-bubble run compiles it (``compile_module`` with its backward cut into an input
and a weight half, ``fxpipe.runtime.pipeline.compiled_split``); the chained stages then run
forward and backward in train mode against the original (``compare.py``: outputs, every parameter
gradient, every buffer, fp32, rtol 1e-4 / atol 1e-5), then in eval mode on the same compiled
stages (the eval-mode graphs). Dropout draws eager's random numbers
(``torch._inductor.config.fallback_random``), so the models with dropout compare too.

The models are chosen for what they make the compiler meet: Mamba (a depthwise convolution whose
backward gives the input's and the weight's gradients in one node, which the halves once failed
to cross), ConvNeXt (a permuted channels-last product inductor lays out otherwise in the input
half than the weight half was compiled for), HuBERT (a CTC loss inductor cannot compile: a graph break that names the operator, the
loss left eager), Mixtral (top-2 routing), T5 (an encoder-decoder), Whisper (a frozen position
table), ResNet-18 (in-place ReLU, ``out += identity``, BatchNorm), GPT-2 (dropout, a tied head),
a dict batch. Every other zoo model passed the same check by hand on 2026-11-28 (the one-graph and
the halves backward), and in train and eval mode on the same compiled stages the next day, except
Falcon there: inductor's vectorized CPU kernels on that host, with two threads, compute its
multi-query attention's backward wrongly, plain ``torch.compile`` of the model alike (docs/compile.md; ``fxpipe verify
--compile`` finds it, tests/runtime/test_compiled_verify.py). They run with the full zoo
(``FXPIPE_ZOO=full``, ``make zoo``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from compare import compare_compiled  # noqa: E402
from registry import ZooModel, select  # noqa: E402

FULL = os.environ.get("FXPIPE_ZOO") == "full"
MODELS = [
    "mamba",
    "convnext",
    "hubert_ctc",
    "mixtral",
    "t5",
    "whisper",
    "resnet18",
    "gpt2",
    "dict_batch",
]
BREAKS = {"hubert_ctc": "aten._ctc_loss_backward"}  # the one graph break each model must report

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not FULL, reason="the whole zoo runs with FXPIPE_ZOO=full (make zoo)"),
]


@pytest.mark.parametrize("model", select(MODELS), ids=lambda m: m.name)
def test_zoo_model_compiled_in_halves_matches_the_original(tmp_path: Path, model: ZooModel) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import CostModel, plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(model.spec)
    traced = trace_model_file(source, 2, progress=False)
    plan = plan_partition(
        traced.profile, 2, microbatches=2, time_limit=2.0, cost=CostModel.preset("loopback")
    )
    write_build_dir(traced, plan, tmp_path / "b", source, batch_size=4, microbatches=2)
    got = compare_compiled(tmp_path / "b", source, eval=True)
    assert got.comparison.ok, got.comparison
    assert got.eval is not None and got.eval.ok, got.eval  # the eval graphs, same stages
    # the halves compiled and ran (a failure would fall back to one graph, with equal gradients)
    assert got.halves_ran and not got.split_failures, got.split_failures
    if model.name in BREAKS:
        assert len(got.breaks) == 1 and BREAKS[model.name] in got.breaks[0], got.breaks
    else:
        assert not got.breaks, got.breaks
