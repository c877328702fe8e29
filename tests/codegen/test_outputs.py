"""The model's output structure in a build (Note [output structure] in fxpipe.codegen.outputs): every
process that rebuilds it -- load_pipeline, the runtime's last stage -- gets the model's own container,
even one registered with pytree only when its library is imported (issue 10, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from codegen_support import ROOT, build_example, build_model_file

from fxpipe.codegen.outputs import dump_output_spec

CONTAINER_IN_MODEL_FILE = """
import dataclasses
import torch
import torch.utils._pytree as pytree

@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor

pytree.register_dataclass(Out, serialized_type_name=f"{__name__}.Out")

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return Out(logits=self.b(h), hidden=h)

def build_model():
    torch.manual_seed(0)
    return Net()

def example_inputs(b):
    return (torch.ones(b, 4),)
"""


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing imported yet) and return what it printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_specs_of_plain_containers_need_no_import() -> None:
    _, spec = pytree.tree_flatten(({"a": torch.zeros(1)}, [torch.zeros(1)]))
    text, modules = dump_output_spec(spec)
    assert text is not None and modules == ()
    assert dump_output_spec(None) == (None, ())


def test_a_transformers_output_is_rebuilt_where_transformers_was_never_imported(
    tmp_path: Path,
) -> None:
    manifest, _ = build_example(tmp_path / "b", "hf_lm", 2)
    assert manifest.output_modules == ("transformers.modeling_outputs",)
    printed = _fresh_python(
        "import sys, torch\n"
        "from fxpipe.codegen import read_manifest\n"
        "from fxpipe.runtime.pipeline.stage_io import assemble_output\n"
        f"manifest = read_manifest({str(tmp_path / 'b')!r})\n"
        "assert 'transformers' not in sys.modules\n"
        "out = assemble_output(manifest, [torch.tensor(2.0), torch.zeros(2, 3)])\n"
        "print(type(out).__name__, float(out.loss), tuple(out.logits.shape))\n"
    )
    assert printed == "CausalLMOutputWithCrossAttentions 2.0 (2, 3)"  # GPT2LMHeadModel's output


def test_a_container_of_the_model_file_is_rebuilt_by_load_pipeline_in_a_new_process(
    tmp_path: Path,
) -> None:
    model_file = tmp_path / "dataclass_out.py"
    model_file.write_text(CONTAINER_IN_MODEL_FILE)
    manifest, _ = build_model_file(tmp_path / "b", model_file, 2, microbatches=1)
    assert manifest.output_modules == ()  # the model file registers it: imported by load_pipeline
    printed = _fresh_python(
        "import torch, fxpipe\n"
        f"out = fxpipe.load_pipeline({str(tmp_path / 'b')!r})(torch.ones(3, 4))\n"
        "print(type(out).__name__, tuple(out.logits.shape), tuple(out.hidden.shape))\n"
    )
    assert printed == "Out (3, 2) (3, 4)"
