"""Meta builds: stage weights streamed from a checkpoint, and stages that initialise themselves without one."""

from __future__ import annotations

import gc
import json
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from example_models import EXAMPLES
from fxpipe.cli import main
from fxpipe.codegen import load_stage, write_build_dir
from fxpipe.codegen.checkpoint_weights import SKIPPED_SAFETY_NET, open_checkpoint, write_streamed
from fxpipe.codegen.pipeline import load_pipeline
from fxpipe.codegen.check.verify import verify_build
from fxpipe.errors import BuildDirError, WeightsError
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import ModelProfile, trace_model_file


@pytest.fixture(scope="module")
def gpt():
    """The GPT example: a real model (seeded), its checkpoint without the tied copy, and a meta trace."""
    source = load_model_file(EXAMPLES["gpt"])
    torch.manual_seed(7)
    real = source.build_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(source, 2, progress=False, trace_device="meta")
    return source, real, traced


def _checkpoint(model) -> dict[str, torch.Tensor]:
    """The state dict as transformers saves it: each tied tensor once (``lm_head.weight`` left out)."""
    state, seen = {}, set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            state[key] = t.detach().clone().contiguous()
    assert "lm_head.weight" not in state and "wte.weight" in state
    return state


def _save(kind: str, state: dict[str, torch.Tensor], tmp_path: Path) -> Path:
    if kind == "safetensors":
        save_file(state, str(tmp_path / "model.safetensors"))
        return tmp_path / "model.safetensors"
    if kind == "shards":
        shards = tmp_path / "ckpt"
        shards.mkdir()
        keys = sorted(state)
        weight_map = {}
        for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: state[k] for k in part}, str(shards / name))
            weight_map.update({k: name for k in part})
        (shards / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
        return shards
    torch.save(state, tmp_path / "model.pt")
    return tmp_path / "model.pt"


def _build(traced, source, out: Path, weights=None, stages: int = 3):
    plan = plan_partition(traced.profile, stages, microbatches=2)
    return write_build_dir(traced, plan, out, source, batch_size=4, microbatches=2, weights=weights)


@pytest.mark.parametrize("kind", ["safetensors", "shards", "torch_save"])
def test_build_from_checkpoint_equals_the_model_loaded_from_it(gpt, tmp_path, kind):
    source, real, traced = gpt
    path = _save(kind, _checkpoint(real), tmp_path)
    manifest = _build(traced, source, tmp_path / "build", path)
    assert manifest.weights == "checkpoint" and SKIPPED_SAFETY_NET in manifest.skipped_checks
    reference = source.build_model()
    reference.load_state_dict(
        _checkpoint(real), strict=False
    )  # lm_head.weight is tied to wte.weight
    pipeline = load_pipeline(tmp_path / "build")
    inputs = source.example_inputs(4)
    for training in (True, False):
        reference.train(training)
        pipeline.train(training)
        torch.manual_seed(0)
        expected = reference(*inputs)
        torch.manual_seed(0)
        assert torch.equal(pipeline(*inputs), expected)
    if kind == "safetensors":  # fxpipe verify agrees (outputs, gradients, buffers; both modes)
        assert verify_build(tmp_path / "build").ok


def test_checkpoint_keys_that_do_not_fit_are_one_line(gpt, tmp_path):
    source, real, traced = gpt
    state = _checkpoint(real)
    del state["blocks.0.mlp.fc.bias"]
    state["blocks.9.extra"] = torch.zeros(3)
    state["wpe"] = torch.zeros(1, 8, 32)
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightsError) as info:
        _build(traced, source, tmp_path / "build", tmp_path / "bad.safetensors")
    message = str(info.value)
    assert "\n" not in message
    for part in (
        "missing 1 key: blocks.0.mlp.fc.bias",
        "unexpected 1 key: blocks.9.extra",
        "mis-shaped 1 key: wpe [1, 8, 32] (model: [1, 16, 32])",
    ):
        assert part in message
    assert not (tmp_path / "build").exists()


def test_unreadable_checkpoints_are_weights_errors(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="not loadable with torch.load"):
        open_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(WeightsError, match="no such file"):
        open_checkpoint(tmp_path / "absent.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no \\*.safetensors files"):
        open_checkpoint(tmp_path / "empty")


def test_weights_need_a_meta_trace(tmp_path):
    source = load_model_file(EXAMPLES["mlp"])
    traced = trace_model_file(source, 2, progress=False)
    with pytest.raises(WeightsError, match="add --device meta"):
        _build(traced, source, tmp_path / "build", tmp_path / "x.safetensors", stages=2)


def test_writer_holds_one_tensor_at_a_time(tmp_path):
    """Each tensor is fetched only after the previous one was written and dropped."""
    alive: list[weakref.ref] = []

    def fetch(i: int):
        def get() -> torch.Tensor:
            gc.collect()
            assert all(r() is None for r in alive), "a previous tensor is still held"
            t = torch.full((64, 64), float(i))
            alive.append(weakref.ref(t))
            return t

        return get

    write_streamed(
        tmp_path / "w.safetensors",
        [(f"t{i}", (64, 64), torch.float32, fetch(i)) for i in range(4)],
        {"format": "pt"},
    )
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert [float(f.get_tensor(f"t{i}")[0, 0]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]


def test_without_weights_each_stage_initialises_itself(gpt, tmp_path):
    source, _, traced = gpt
    manifest = _build(traced, source, tmp_path / "build")
    assert manifest.weights == "init"
    for sm in manifest.stages:  # only buffers are written
        with safe_open(str(tmp_path / "build" / sm.weights), framework="pt") as f:
            assert set(f.keys()) <= set(sm.buffers + sm.constants)
    with pytest.warns(
        UserWarning, match=r"stage 0: 1 tensors have no module initialiser \(\['wpe'\]"
    ):
        first = [load_stage(tmp_path / "build", i) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = [load_stage(tmp_path / "build", i) for i in range(3)]
        pipeline = load_pipeline(tmp_path / "build")
    for a, b in zip(first, again):  # deterministic
        assert all(
            torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())
        )
        assert not any(t.is_meta for t in a.state_dict().values())
    (tie,) = manifest.ties
    (s0, s1), (k0, k1) = tie.stages, tie.keys
    assert torch.equal(
        first[s0].state_dict()[k0], first[s1].state_dict()[k1]
    )  # tied copies identical
    linear = first[0].state_dict()["blocks.0.attn.qkv.weight"]
    assert 0 < float(linear.abs().max()) <= 1 / 32**0.5  # nn.Linear's own kaiming-uniform bound
    assert torch.equal(
        first[0].state_dict()["blocks.0.attn.mask"],
        torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16),
    )
    out = pipeline(*source.example_inputs(4))
    assert out.shape == (4, 16, 64) and torch.isfinite(out).all()
    with pytest.raises(BuildDirError, match="without --weights: each stage initialises itself"):
        verify_build(tmp_path / "build")


def test_cli_partition_on_meta_from_a_checkpoint(tmp_path, capsys):
    torch.manual_seed(3)
    save_file(
        load_model_file(EXAMPLES["mlp"]).build_model().state_dict(),
        str(tmp_path / "model.safetensors"),
    )
    out = tmp_path / "build"
    assert (
        main(
            [
                "partition",
                str(EXAMPLES["mlp"]),
                "--stages",
                "2",
                "--device",
                "meta",
                "--weights",
                str(tmp_path / "model.safetensors"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "skipped safety net" in " ".join(capsys.readouterr().out.split())
    assert main(["verify", str(out)]) == 0
    profile = ModelProfile.from_json(
        out / "profile.json"
    )  # the meta trace is recorded and read back
    assert profile.meta and profile.skipped_checks and profile.trace_device == "cpu"


_LIST_INDEX_MODEL = """
import torch


class ListIndex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x)[..., [1, 0, 2, 3, 4, 5, 6, 7]])  # the index list becomes a tensor in forward


def build_model():
    return ListIndex()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_a_tensor_made_in_forward_has_no_value_on_meta_and_the_error_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch.export lifts ``x[..., [1, 0, ...]]``'s index list as a constant, made on the meta device when the
    model is traced there (transformers 5.24's Falcon does this): one line that names it and the way out."""
    model_file = tmp_path / "list_index.py"
    model_file.write_text(_LIST_INDEX_MODEL)
    assert (
        main(
            [
                "partition",
                str(model_file),
                "--frontend",
                "export",
                "--device",
                "meta",
                "--stages",
                "2",
                "--out",
                str(tmp_path / "build"),
            ]
        )
        != 0
    )
    err = capsys.readouterr().err
    assert "'_fxpipe_const_0' is a tensor the model makes in forward from Python values" in err
    assert "Trace on cpu" in err and "Traceback" not in err
    assert (
        main(
            [
                "partition",
                str(model_file),
                "--frontend",
                "export",
                "--stages",
                "2",
                "--out",
                str(tmp_path / "build"),
            ]
        )
        == 0
    )  # on cpu it has its value
