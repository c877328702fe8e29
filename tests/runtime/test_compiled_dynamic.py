"""A compiled build with a dynamic sequence dimension (#36, Note [compiled dynamic dimensions]):
the stages' inputs have their length dimensions marked dynamic and the warm-up runs at two
lengths, so steps at other lengths train like eager one-process training and compile nothing.

``varlen_lm.py`` (lengths 2..24, traced at 12) on two stages of one rank (interleaved-1f1b), so the
boundary tensors carry the length too; the oracle is the original model, eager, on the same
batches (rtol 1e-4: compiled kernels round differently, as in ``test_compiled.py``)."""

from __future__ import annotations

import copy
import socket
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from builds import make_build, original_model
from fxpipe.codegen import load_stage
from fxpipe.codegen.manifest import Manifest
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.pipeline.compiled import compiled_graphs

MODEL = Path(__file__).with_name("varlen_lm.py")
BATCH, MICRO, LR = 4, 2, 0.1
LENGTHS = (5, 16, 9)  # neither the traced length (12) nor the warm-up's second (13)
CLOSE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture()
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)


def test_a_compiled_dynamic_build_runs_every_length_without_recompiling(
    one_rank: None, tmp_path: Path
) -> None:
    build = make_build(MODEL, tmp_path / "build", 1, BATCH, MICRO, schedule="interleaved-1f1b")
    manifest = Manifest.from_json(build)
    assert manifest.num_stages == 2 and [r.name for r in manifest.dynamic] == ["seq"]
    source = load_model_file(MODEL)
    batches = [source.module._batch(BATCH, n, n) for n in LENGTHS]

    model: nn.Module = original_model(build, source, 2).train()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    want = []
    for x, y in batches:
        opt.zero_grad()
        step = [source.loss_fn(reference(a), b) for a, b in zip(x.chunk(MICRO), y.chunk(MICRO))]
        (sum(step) / MICRO).backward()
        opt.step()
        want.append(sum(float(v.detach()) for v in step) / MICRO)

    before = compiled_graphs()
    runner = PipelineRunner(
        manifest,
        source.loss_fn,
        stage_loader=lambda i, device: load_stage(build, i, device=device),
        schedule="interleaved-1f1b",
        microbatches=MICRO,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=120,
        compile="stage",
    )
    try:
        assert [c.stage for c in runner.compiled] == [0, 1]
        graphs = compiled_graphs()
        # one graph per stage: the warm-up's second length ran the first length's graph, whose
        # length dimensions were marked dynamic
        assert graphs - before == 2
        got = [float(runner.step((x,), y)) for x, y in batches]
        assert compiled_graphs() == graphs  # no length compiled anything
        state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    finally:
        runner.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **CLOSE)
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k], v, **CLOSE, msg=k)
