"""Checks on data in forward (issue 37 items 2 and 4; Note [checks on data] in fxpipe.tracer.frontend.data_checks).

A check that only raises (``if labels.max() >= vocab: raise``, transformers' CTC heads) no longer
stops torch.export: it becomes a runtime assert in the stage that holds the data, which refuses a
bad microbatch with the check's own file, line and code. CTC loss with tensor lengths exports (a
fake kernel torch lacks). A branch that computes something is refused with its line, each front
end's stop on a line of its own, and what to try.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.errors import TraceError
from fxpipe.tracer import trace_model

VOCAB = 7


class CheckedCTC(nn.Module):
    """A CTC head in the transformers way: checks its labels, CTC loss with tensor lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.encoder(x))
        if labels.max() >= VOCAB:
            raise ValueError(f"Label values must be <= vocab_size: {VOCAB}")
        mask = labels >= 0
        log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)
        input_lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels.masked_select(mask), input_lengths, mask.sum(-1))


def _inputs(batch: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(1, VOCAB, (batch, 3), generator=gen)
    labels[-1, -1] = -100
    if bad:
        labels[0, 0] = VOCAB
    return torch.randn(batch, 8, 5, generator=gen), labels


MODEL_FILE = """
import sys
sys.path.insert(0, {here!r})
from test_data_checks import CheckedCTC, _inputs
import torch

def build_model():
    torch.manual_seed(0)
    return CheckedCTC()

def example_inputs(batch_size):
    return _inputs(batch_size)
"""


def test_a_check_that_only_raises_becomes_a_runtime_assert_in_the_stages(tmp_path: Path) -> None:
    from fxpipe.codegen import load_pipeline, write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    path = tmp_path / "ctc.py"
    path.write_text(MODEL_FILE.format(here=str(Path(__file__).resolve().parent)))
    source = load_model_file(path)
    with pytest.warns(
        UserWarning, match=r"kept test_data_checks\.py:\d+ .*labels\.max\(\).* runtime assert"
    ):
        traced = trace_model_file(source, 2, frontend="export", progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    build = tmp_path / "build"
    write_build_dir(traced, plan, build, source, batch_size=4, microbatches=2)  # the safety net
    pipeline = load_pipeline(build)
    model = source.build_model()
    for batch in (2, 3):
        torch.testing.assert_close(pipeline(*_inputs(batch)), model(*_inputs(batch)))
    with pytest.raises(ValueError, match="Label values"):
        model(*_inputs(2, bad=True))
    with pytest.raises(
        RuntimeError,
        match=r"the model's check at test_data_checks\.py:\d+ \(`if labels\.max\(\) >= VOCAB:`\) failed",
    ):
        pipeline(*_inputs(2, bad=True))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # computes something on either side: no trace holds both
            h = h * 2
        return h


def test_both_front_ends_say_which_line_stopped_them_and_what_to_try() -> None:
    with pytest.raises(TraceError) as info:
        trace_model(_Branchy(), (torch.randn(2, 4),), progress=False)
    lines = str(info.value).splitlines()
    assert len(lines) == 4
    assert re.fullmatch(
        r"could not trace _Branchy: symbolic FX and torch\.export each stopped .*", lines[0]
    )
    site = r"test_data_checks\.py:\d+ \(`if h\.sum\(\) > 0:  # computes something.*`\)"
    assert lines[1].startswith("  symbolic (torch.fx): ") and re.search(site, lines[1])
    assert lines[2].startswith("  export (torch.export): DataBranch: ") and re.search(
        site, lines[2]
    )
    assert lines[3].startswith("try: ") and "torch.where" in lines[3] and "--leaf" in lines[3]


class _NumpyNoise(nn.Module):
    """SpecAugment's way: a random mask drawn with numpy in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        keep = torch.from_numpy(np.random.rand(4) > 0.5)
        return self.lin(x) * keep


def test_random_numbers_drawn_with_numpy_are_refused_naming_the_line() -> None:
    with pytest.raises(TraceError) as info:
        trace_model(_NumpyNoise(), (torch.randn(2, 4),), frontend="export", progress=False)
    assert re.search(
        r"_NumpyNoise draws random numbers with numpy in forward at test_data_checks\.py:\d+ "
        r"\(`keep = torch\.from_numpy\(np\.random\.rand\(4\) > 0\.5\)`\).*torch\.rand",
        str(info.value),
    )
