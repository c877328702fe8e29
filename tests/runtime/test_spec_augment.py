"""SpecAugment at run time (issue 37): a speech encoder that masks its features with numpy in train
mode trains on 2 ranks as one process trains it, drawing new masks every microbatch.

Wav2Vec2 for CTC with ``labels=`` and SpecAugment on (time and feature masks, probabilities high
enough that every microbatch is masked), partitioned at 2 stages; its masks come from
transformers' own ``_compute_mask_indices`` at every call, on the rank that holds the masking
(Note [masks drawn on the host]). The one-process run and every rank seed numpy alike; the
one-process run takes the microbatches in order, as the pipeline's first stage does. With and
without recomputing the first stage (Note [numpy under recomputation]).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from builds import make_build
from fxpipe.runtime.pipeline.recompute import checkpointed

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"
if str(ZOO) not in sys.path:
    sys.path.insert(0, str(ZOO))

import wav2vec2_ctc  # noqa: E402

BATCH, MICROBATCHES, STEPS, LR, SEED = 4, 2, 2, 0.1, 11
MASKING = dict(
    mask_time_prob=0.3, mask_time_length=4, mask_feature_prob=0.25, mask_feature_length=4
)


def build_model() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    return Wav2Vec2ForCTC(Wav2Vec2Config(**wav2vec2_ctc.config(**MASKING))).train()


example_inputs = wav2vec2_ctc.example_inputs
MODEL_FILE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_spec_augment import build_model, example_inputs
"""


def _chunks() -> list[dict[str, torch.Tensor]]:
    batch = example_inputs(BATCH)
    return [{k: v.chunk(MICROBATCHES)[m] for k, v in batch.items()} for m in range(MICROBATCHES)]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    np.random.seed(SEED)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for chunk in _chunks():  # in order, as the first stage runs them
            loss = model(**chunk).loss
            (loss / MICROBATCHES).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_job(rank: int, world: int, build: str) -> dict[str, Any]:
    from fxpipe.runtime import PipelineRunner

    out = {}
    for name, recompute in (("plain", ()), ("recompute", (True, False))):
        np.random.seed(SEED)  # every rank, as the one-process run does
        with PipelineRunner(
            build,
            None,
            microbatches=MICROBATCHES,
            timeout_s=120,
            recompute=recompute,
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        ) as runner:
            losses = [runner.step(example_inputs(BATCH)) for _ in range(STEPS)]
            state = {k: v.detach().clone() for k, v in runner.stage.state_dict().items()}
        out[name] = {"losses": losses, "state": state}
    return out


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spec_augment")
    (root / "speech.py").write_text(MODEL_FILE)
    # the build's check compares the stages with the model in train mode: masks drawn alike
    return make_build(root / "speech.py", root / "build", 2, BATCH, MICROBATCHES)


def test_the_masks_are_drawn_by_the_stage_at_every_call(build: Path) -> None:
    """No mask is a constant of the build: the stage calls the model's own mask function, so
    another numpy state draws other masks and the same state the same ones."""
    from fxpipe.codegen.load import load_stage

    sources = "".join(p.read_text() for p in sorted(build.glob("stage_*.py")))
    assert sources.count("torch.ops.fxpipe.host_mask_indices.default(") == 2  # time and feature
    assert "modeling_wav2vec2._compute_mask_indices" in sources
    stage = load_stage(build, 0).train()
    chunk = _chunks()[0]
    with torch.no_grad():
        runs = []
        for seed in (1, 1, 2):
            np.random.seed(seed)
            runs.append(stage(chunk["input_values"], chunk["labels"]))
    masked = [t for t in runs[0] if t.is_floating_point()]
    assert masked
    for a, b, c in zip(runs[0], runs[1], runs[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, c) for a, c in zip(runs[0], runs[2]) if a.is_floating_point())


@pytest.mark.distributed
@pytest.mark.slow
def test_a_model_with_spec_augment_trains_on_2_ranks_like_one_process(build: Path) -> None:
    from spawn import spawn

    want_losses, want_state = _reference()
    results = [r.value for r in spawn(_train_job, 2, str(build), timeout=300)]
    for name in ("plain", "recompute"):
        for r in results:
            torch.testing.assert_close(
                torch.tensor(r[name]["losses"]),
                torch.tensor(want_losses),
                msg=lambda m: f"{name}: {m}",
            )
        state = {**results[0][name]["state"], **results[1][name]["state"]}
        assert state and set(state) <= set(want_state)
        for key, value in state.items():
            torch.testing.assert_close(value, want_state[key], msg=lambda m: f"{name} {key}: {m}")
    # the masks matter: without them (eval-mode features) the first loss is another number
    np.random.seed(SEED)
    model = build_model()
    with torch.no_grad():
        plain = model(**{**_chunks()[0]}).loss
        model.config.mask_time_prob = model.config.mask_feature_prob = 0.0
        unmasked = model(**_chunks()[0]).loss
    assert not torch.equal(plain, unmasked)


class _NumpyNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5)
        return self.linear(x * keep).square()


def test_recomputation_draws_what_the_forward_drew_and_leaves_numpy_as_a_plain_forward_does() -> (
    None
):
    module, x = _NumpyNoise(), torch.randn(4, 8)
    np.random.seed(3)
    module(x).sum().backward()
    want = module.linear.weight.grad.clone()
    after_plain = np.random.get_state()[1].copy()
    module.zero_grad()
    np.random.seed(3)
    checkpointed(module, x.requires_grad_(False)).sum().backward()
    torch.testing.assert_close(module.linear.weight.grad, want, rtol=0, atol=0)
    assert np.array_equal(np.random.get_state()[1], after_plain)


MODEL_FILE_COPY = """
import numpy as np
import torch
import torch.nn as nn


def _compute_mask_indices(shape, mask_prob, mask_length, attention_mask=None, min_masks=0):
    return np.random.rand(*shape) < mask_prob  # the model file's own copy, as some speech repos have


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if self.training:
            mask = _compute_mask_indices((h.shape[0], h.shape[1]), 0.5, 1)
            h = h.masked_fill(torch.tensor(mask, dtype=torch.bool)[..., None], 0.0)
        return self.b(h)


def build_model():
    torch.manual_seed(0)
    return Masked().train()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 6, 8),)
"""

_FRESH_WORKER = """
import sys, numpy as np, torch
from fxpipe.codegen.load import load_stage
stage = load_stage(sys.argv[1], 0).train()
runs = []
for seed in (5, 5, 6):
    np.random.seed(seed)
    with torch.no_grad():
        runs.append([t for t in stage(torch.ones(2, 6, 8)) if t.is_floating_point()])
torch.save(runs, sys.argv[2])
"""


def test_a_model_files_own_mask_function_is_found_by_a_fresh_worker(tmp_path: Path) -> None:
    """A model file's copy of ``_compute_mask_indices`` lives in a module named after the file's
    path (``fxpipe_model_<stem>_<digest>``): a worker that loads only the stage finds it (before:
    ``ModuleNotFoundError`` at the first train-mode forward, after the build's check passed in the
    process that traced), and draws from numpy's state (the build's check compared those draws
    with the model's)."""
    import subprocess

    (tmp_path / "masked.py").write_text(MODEL_FILE_COPY)
    build = make_build(tmp_path / "masked.py", tmp_path / "build", 2, 4, 2)
    text = (build / "stage_0.py").read_text()
    assert "host_mask_indices" in text and "fxpipe_model_" not in text  # no path-derived name

    out = tmp_path / "runs.pt"
    subprocess.run(
        [sys.executable, "-c", _FRESH_WORKER, str(build), str(out)],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    same, again, other = torch.load(out)
    assert same and len(same) == len(again) == len(other)
    for a, b in zip(same, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(not torch.equal(a, c) for a, c in zip(same, other))


def test_a_graph_kept_for_a_second_backward_is_recomputed_with_the_forwards_draws_again() -> None:
    """Non-reentrant checkpointing recomputes once per backward over a kept graph (B then W of a
    split backward run two): numpy's state is replayed each time (before: the second recomputation
    failed entering the replay a second time)."""
    module, x = _NumpyNoise(), torch.randn(4, 8, requires_grad=True)
    np.random.seed(3)
    module(x).sum().backward()
    want = module.linear.weight.grad.clone()
    module.zero_grad()
    np.random.seed(3)
    out = checkpointed(module, x).sum()
    torch.autograd.grad(out, x, retain_graph=True)  # the input's gradient, as B computes it
    torch.autograd.backward(out, inputs=[module.linear.weight])  # the weight's, as W does
    torch.testing.assert_close(module.linear.weight.grad, want, rtol=0, atol=0)


def test_a_model_file_that_imports_transformers_mask_function_draws_at_run_time(
    tmp_path: Path,
) -> None:
    """A model file that reuses transformers' SpecAugment (``from ...modeling_wav2vec2 import
    _compute_mask_indices``) builds: the operator names the module that defines the function
    (before: refused, "draws random numbers with numpy in forward at modeling_wav2vec2.py"), the
    build's check compares the masks in train mode, and the model file's name is the function
    again after the trace."""
    from transformers.models.wav2vec2 import modeling_wav2vec2

    from fxpipe.modelfile import import_model_module

    text = MODEL_FILE_COPY.split("def _compute_mask_indices", 1)[0] + (
        "from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices\n\n\n"
        "class Masked" + MODEL_FILE_COPY.split("class Masked", 1)[1]
    )
    (tmp_path / "imported.py").write_text(text)
    build = make_build(tmp_path / "imported.py", tmp_path / "build", 2, 4, 2)
    sources = "".join(p.read_text() for p in sorted(build.glob("stage_*.py")))
    assert "'transformers.models.wav2vec2.modeling_wav2vec2._compute_mask_indices'" in sources
    module = import_model_module(tmp_path / "imported.py")
    assert module._compute_mask_indices is modeling_wav2vec2._compute_mask_indices


def test_a_mask_function_the_worker_cannot_import_is_named_in_one_line() -> None:
    """A stage whose mask function is gone where it runs (another transformers, a model file not
    there) is refused naming the function and the remedy, not with a bare ImportError."""
    from fxpipe.errors import BuildDirError
    from fxpipe.tracer.frontend.host_masks import host_mask_indices

    for missing in ("fxpipe_no_such_module._compute_mask_indices", "numpy._compute_mask_indices"):
        with pytest.raises(BuildDirError, match=r"draws SpecAugment's masks with .*packages"):
            host_mask_indices(missing, [2, 6], 0.5, 1, None, 0)
