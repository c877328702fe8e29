"""``fxpipe export`` of a transformers model, loaded back by ``from_pretrained``.

GPT-2 (``examples/hf_lm.py``: tiny config, tied head, nothing downloaded) is partitioned
into 2 stages, trained 2 steps with a checkpoint, exported to ``model.safetensors`` next to
the model's own ``config.json`` (``save_pretrained``'s config): ``GPT2LMHeadModel.from_pretrained``
loads it with no missing or unexpected keys and computes what the trained stages' gathered
weights compute, which is not what the untrained model computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from example_models import HF_LM
from fxpipe.cli import main
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.checkpoint import gather_state_dict
from fxpipe.runtime.train.training_options import TrainingOptions
from spawn import spawn


def _job(rank: int, world: int, build: str, options: RunOptions) -> Any:
    from fxpipe.runtime.train.loop import train

    return train(Path(build), options).losses


@pytest.mark.distributed
@pytest.mark.slow
def test_exported_gpt2_loads_with_from_pretrained_and_computes_the_trained_model(
    tmp_path: Path,
) -> None:
    from transformers import GPT2LMHeadModel

    build, ck, out = tmp_path / "build", tmp_path / "ck", tmp_path / "hf"
    assert (
        main(
            [
                "partition",
                str(HF_LM),
                "--stages",
                "2",
                "--batch-size",
                "4",
                "--microbatches",
                "2",
                "--solver",
                "params",
                "--out",
                str(build),
            ]
        )
        == 0
    )
    options = RunOptions(
        steps=2, lr=0.5, timeout_s=60, training=TrainingOptions(checkpoint_dir=str(ck))
    )
    losses = spawn(_job, 2, str(build), options, timeout=240)[0].value
    assert len(losses) == 2
    assert main(["export", str(ck), "--out", str(out / "model.safetensors")]) == 0
    source = load_model_file(HF_LM)
    untrained = source.build_model().eval()
    untrained.config.save_pretrained(out)  # the config only: the weights are the export's

    loaded, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert (
        not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ), info
    trained = source.build_model()
    trained.load_state_dict(gather_state_dict(ck))  # strict: the original keys
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want, before = (m.eval()(input_ids=ids).logits for m in (loaded, trained, untrained))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(want, before)  # training changed the model, and the export carries it
    assert (
        loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    )  # still tied


@pytest.mark.distributed
@pytest.mark.slow
def test_export_pretrained_llama_with_tied_embeddings_loads_with_auto_model(
    tmp_path: Path,
) -> None:
    """``fxpipe export D --pretrained DIR``: save_pretrained's layout of the checkpoint's model,
    its config from the model file the checkpoint names; ``AutoModelForCausalLM`` loads it with
    the checkpoint's tensors, the embedding and the head tied as transformers ties them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    llama = Path(__file__).with_name("tp_llama.py")
    build, ck, hf = tmp_path / "build", tmp_path / "ck", tmp_path / "hf"
    args = ["--microbatches", "2", "--solver", "params", "--out", str(build)]
    assert main(["partition", str(llama), "--stages", "2", "--batch-size", "4", *args]) == 0
    options = RunOptions(
        steps=2, lr=0.05, timeout_s=60, training=TrainingOptions(checkpoint_dir=str(ck))
    )
    spawn(_job, 2, str(build), options, timeout=240)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(ck), "--out", str(out), "--pretrained", str(hf)]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in hf.iterdir()}
    written = load_file(str(hf / "model.safetensors"))  # the tie stored once, as transformers does
    assert "model.embed_tokens.weight" in written and "lm_head.weight" not in written

    state = gather_state_dict(ck)
    untrained = load_model_file(llama).build_model().state_dict()
    assert not torch.equal(state["model.norm.weight"], untrained["model.norm.weight"])
    loaded, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    got = loaded.state_dict()
    assert set(got) == set(state)
    for key, value in state.items():
        assert torch.equal(got[key], value), key
    plain = load_file(str(out))  # the plain export: every key, the tie under both names
    assert set(plain) == set(state)
    assert torch.equal(plain["lm_head.weight"], plain["model.embed_tokens.weight"])


def test_export_pretrained_refuses_in_one_line(tmp_path: Path) -> None:
    """A model file named relative to its build, one that changed since, a model that is not a
    transformers one, an --pretrained directory that holds files: one line each, nothing written."""
    from fxpipe.errors import CheckpointError
    from fxpipe.modelfile import file_sha256
    from fxpipe.runtime.train.export_pretrained import export_pretrained

    mlp = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    state = load_model_file(mlp).build_model().state_dict()
    out = tmp_path / "hf"
    cases = [
        ({"model_file": "../model.py"}, "names '../model.py' relative to its build; give --model"),
        ({"model_file": str(mlp), "model_sha256": "0" * 64}, "changed since the checkpoint"),
        (
            {"model_file": str(mlp), "model_sha256": file_sha256(mlp), "model_fn": "build_model"},
            "builds a MLP, not a transformers PreTrainedModel",
        ),
    ]
    for build, line in cases:
        with pytest.raises(CheckpointError, match=line.replace("(", r"\(")):
            export_pretrained(tmp_path, state, out, {"build": build})
        assert not out.exists()
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        export_pretrained(tmp_path, state, out, {}, model=str(mlp))
