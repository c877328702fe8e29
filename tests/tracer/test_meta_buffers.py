"""A model that builds itself on the meta device (torchtitan's way: the whole factory under
``with torch.device("meta")``) has its computed buffers recomputed on the CPU (Note [computed
buffers on meta] in ``fxpipe.tracer.construct.meta_buffers``): a tiny Llama's RoPE frequencies and a
causal mask equal those of the same model built on the CPU, the build writes them, and each
is named in the profile."""

from __future__ import annotations

import math
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fxpipe.codegen import write_build_dir
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model, trace_model_file

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"
if str(ZOO) not in sys.path:
    sys.path.append(str(ZOO))

MODEL_FILE = textwrap.dedent(
    f'''
    import math
    import sys

    import torch
    import torch.nn as nn

    sys.path.append({str(ZOO)!r})
    import _zoo
    from _zoo import lm_inputs as example_inputs


    class CausalMixer(nn.Module):
        """A layer with computed buffers, torchtitan-style: a causal mask and sinusoidal positions."""

        def __init__(self, width, seq):
            super().__init__()
            self.proj = nn.Linear(width, width)
            self.register_buffer("mask", torch.tril(torch.ones(seq, seq)), persistent=False)
            pos = torch.arange(seq)[:, None] / 10000 ** (torch.arange(width)[None] / width)
            self.register_buffer("positions", torch.sin(pos), persistent=False)

        def forward(self, x):
            s = x.shape[1]
            w = self.mask[:s, :s] / self.mask[:s, :s].sum(-1, keepdim=True)
            return self.proj(w @ (x + self.positions[:s]))


    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            from transformers import LlamaConfig, LlamaModel

            self.llama = LlamaModel(LlamaConfig(use_cache=False, **_zoo.decoder_config()))
            self.mix = CausalMixer(self.llama.config.hidden_size, 32)

        def forward(self, input_ids, attention_mask):
            h = self.llama(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self.mix(h)


    def build_model():
        with torch.device("meta"):
            return Tiny()


    def build_cpu():
        torch.manual_seed(0)
        return Tiny()
    '''
)

RECOMPUTED = (
    "llama.rotary_emb.inv_freq",
    "llama.rotary_emb.original_inv_freq",
    "mix.mask",
    "mix.positions",
)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("meta_buffers") / "tiny_meta.py"
    path.write_text(MODEL_FILE)
    return path


def test_buffers_built_on_meta_are_recomputed_equal_to_a_cpu_build_and_written(
    model_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = load_model_file(model_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(source, 2, progress=False)
    assert traced.profile.meta
    lines = traced.profile.recomputed_buffers
    assert [line.split(":")[0] for line in lines] == list(RECOMPUTED)
    assert "LlamaRotaryEmbedding rebuilt from its constructor's arguments" in lines[0]
    assert "CausalMixer rebuilt from its constructor's arguments" in lines[2]
    plan = plan_partition(traced.profile, 2, microbatches=2, time_limit=2.0)
    build = tmp_path / "build"
    manifest = write_build_dir(traced, plan, build, source, batch_size=4, microbatches=2)
    written: dict[str, torch.Tensor] = {}
    for sm in manifest.stages:
        written.update(load_file(str(build / sm.weights)))
    cpu = load_model_file(model_file, model_fn="build_cpu").build_model()
    want = dict(cpu.named_buffers())
    for key in ("llama.rotary_emb.inv_freq", "mix.mask", "mix.positions"):  # what forward reads
        assert key in written, key
        torch.testing.assert_close(written[key], want[key], rtol=0, atol=0, msg=key)
    # the build says which buffers were recomputed and how: its manifest and its report
    from fxpipe.codegen.manifest import Manifest

    assert Manifest.from_json(build / "manifest.json").recomputed_buffers == lines
    report = (build / "report.html").read_text()
    assert "Buffers recomputed on the CPU" in report
    assert all(key in report for key in RECOMPUTED)
    assert "rebuilt from its constructor&#x27;s arguments" in report
    from fxpipe.cli import main

    capsys.readouterr()
    assert main(["report", str(build)]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("recomputed")]
    assert [line.split()[1].rstrip(":") for line in shown] == list(RECOMPUTED)


def test_rope_frequencies_come_from_the_config_without_a_build_record() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import _zoo

    config = LlamaConfig(use_cache=False, **_zoo.decoder_config())
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    cpu = LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model(meta, _zoo.lm_inputs(2), progress=False)
    lines = traced.profile.recomputed_buffers
    assert len(lines) == 2 and "LlamaRotaryEmbedding rebuilt from its config" in lines[0]
    from fxpipe.graphmeta import BUFFER_VALUES_KEY

    values = traced.graph_module.meta[BUFFER_VALUES_KEY]
    torch.testing.assert_close(
        values["model.rotary_emb.inv_freq"], cpu.model.rotary_emb.inv_freq, rtol=0, atol=0
    )
    assert not math.isnan(float(values["model.rotary_emb.inv_freq"].sum()))
