"""A stage boundary that carries a tensor whose shape depends on the data (#36): the tokens a mask
keeps, packed (``h[mask]``). The tracer marks the dimension ``"?"`` (not the ``3*mb`` its traced
sizes suggest), the manifest names the tensor, and the runtime sends its shape ahead of it (Note
[data-dependent messages]): 2 ranks train equal to one process while every microbatch packs another
number of tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from builds import original_model
from fxpipe.codegen import Manifest, write_build_dir
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.runtime.train.data_iter import RankInfo
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.tracer import trace_model_file
from spawn import spawn

MODEL = Path(__file__).with_name("packed_tokens.py")
BATCH, MICROBATCHES, STEPS, LR = 4, 2, 3, 0.1


def _build(out: Path, frontend: str) -> Path:
    source = load_model_file(MODEL)
    traced = trace_model_file(source, BATCH // MICROBATCHES, progress=False, frontend=frontend)
    plan = plan_partition(traced.profile, 2, microbatches=MICROBATCHES, split_at=("mlp_in",))
    write_build_dir(traced, plan, out, source, batch_size=BATCH, microbatches=MICROBATCHES)
    return out


def _packed(build: Path) -> list[Any]:
    manifest = Manifest.from_json(build)
    return [o for s in manifest.stages for o in s.outputs if o.data_dependent]


@pytest.fixture(scope="module")
def symbolic_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build for the tests that do not vary the front end."""
    return _build(tmp_path_factory.mktemp("packed") / "build", "symbolic")


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_the_manifest_names_the_tensor_whose_shape_depends_on_the_data(
    tmp_path: Path, frontend: str, symbolic_build: Path
) -> None:
    build = symbolic_build if frontend == "symbolic" else _build(tmp_path / "build", frontend)
    (packed,) = _packed(build)
    assert packed.producer == 0 and packed.consumers == (1,)
    assert packed.dims == ("?", "8")  # the example keeps 3 tokens a sample: not '3*mb'
    assert "[?, 8]" in (build / "stage_1.py").read_text()


def test_fxpipe_report_says_which_shape_is_sent(
    symbolic_build: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fxpipe.cli import main

    build = symbolic_build
    (packed,) = _packed(build)
    assert main(["report", str(build)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"data-dependent shape: {packed.name!r} float32[?, 8] (stage 0 to 1): its shape depends on "
        "the data and is sent ahead of it" in out
    )


def _train_job(rank: int, world: int, build: str) -> Any:
    import fxpipe.runtime.train.loop as training

    options = RunOptions(steps=STEPS, lr=LR, timeout_s=60, schedule="1f1b")
    return training.train(Path(build), options, Path(build) / f"run_{rank}.json")


def _reference(build: Path) -> list[float]:
    source = load_model_file(MODEL)
    model = original_model(build, source, 2).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    stream = source.module.train_batches(BATCH, RankInfo(0, 1, 0, 1, 0, 1, True, True))
    losses = []
    for _ in range(STEPS):
        (x, mask), y = next(stream)
        opt.zero_grad()
        total = 0.0
        for k in range(MICROBATCHES):
            chunk = lambda t: t.chunk(MICROBATCHES)[k]  # noqa: E731
            loss = source.loss_fn(model(chunk(x), chunk(mask)), chunk(y))
            (loss / MICROBATCHES).backward()
            total += loss.item()
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses


@pytest.mark.distributed
def test_a_packed_tensor_between_stages_trains_like_one_process(symbolic_build: Path) -> None:
    """The symbolic front end's build; the export front end's trains the same (checked by hand:
    its stage 0 asserts the packed size is not negative, as torch.export emits)."""
    build = symbolic_build
    assert [o.name for o in _packed(build)]
    record = spawn(_train_job, 2, str(build), timeout=240)[0].value
    want = _reference(build)
    torch.testing.assert_close(
        torch.tensor(record.losses), torch.tensor(want), rtol=1e-5, atol=1e-6
    )
