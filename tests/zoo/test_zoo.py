"""The conformance zoo partitions and matches the original in TRAIN mode (issue 10).

Every zoo model (``registry.py``) is traced with the default front end, cut into 2 stages (and 4
for ``FOUR_STAGES``), and the chained stages are compared with ``build_model()`` given the build's
weights: outputs, every parameter gradient, every buffer afterwards, fp32, the zoo's tolerance
(``compare.py``). Eval mode is not checked here yet (issue 10, item 5).

The default run takes ``QUICK`` (one model per kind of fix, 2 stages, about a minute); the whole zoo
runs with ``FXPIPE_ZOO=full`` (``make zoo``). Cases that fail today for a reason being fixed
elsewhere are strict xfails (``KNOWN``): each must start passing once its fix lands, and then
leaves the list.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from compare import compare_pipeline  # noqa: E402
from registry import ZooModel, zoo_models  # noqa: E402

FULL = os.environ.get("FXPIPE_ZOO") == "full"
MICROBATCH = 2
QUICK = {"regnet", "vit_mha", "transformer_encoder", "bloom"}  # in-place ops + BN, MHA, auto -> export, HF
FOUR_STAGES = {"resnet18", "densenet", "efficientnet", "googlenet", "vit_mha", "transformer_encoder", "llama",
               "mixtral", "t5", "bart", "gpt2"}
_ITEM_3 = "issue 10 item 3: a forward argument whose default the graph uses"
_RNG_ORDER = ("dropout masks drawn in another order: the plan runs decoder units that draw random numbers in "
              "an earlier stage than the encoder's last ones (the partitioner does not keep random ops in "
              "program order)")
KNOWN: dict[tuple[str, int | None], str] = {  # (model, stages or None for all) -> why it fails today
    ("falcon", None): f"{_ITEM_3} (past_key_values=None)",
    ("vit_timm", None): f"{_ITEM_3} (attn_mask=None)",
    ("bart", 2): _RNG_ORDER,
    ("bart", 4): _RNG_ORDER,
    ("t5", 4): _RNG_ORDER,
}
# CP-SAT's plan (time-limited; often one of several equally good ones) can vary from run to run, and some
# plans keep the order: these cases may pass, so they are not strict
MAY_PASS = {case for case, reason in KNOWN.items() if reason == _RNG_ORDER}

_traced: dict[str, Any] = {}  # model name -> (traced, source), or the exception tracing raised


def _trace(model: ZooModel) -> tuple[Any, Any]:
    """Trace each zoo model once per session (every stage count reuses it)."""
    if model.name not in _traced:
        from fxpipe.modelfile import load_model_file
        from fxpipe.tracer import trace_model_file

        try:
            source = load_model_file(model.spec)
            _traced[model.name] = (trace_model_file(source, MICROBATCH, progress=False), source)
        except Exception as exc:  # noqa: BLE001 - re-raised by every case of this model
            _traced[model.name] = exc
    result = _traced[model.name]
    if isinstance(result, Exception):
        raise result
    return result


def _cases() -> list[Any]:
    cases = []
    for model in zoo_models():
        for stages in (2, 4):
            if stages == 4 and model.name not in FOUR_STAGES:
                continue
            marks = [pytest.mark.slow]
            if not FULL and (model.name not in QUICK or stages != 2):
                marks.append(pytest.mark.skip(reason="the whole zoo runs with FXPIPE_ZOO=full (make zoo)"))
            reason = KNOWN.get((model.name, stages)) or KNOWN.get((model.name, None))
            if reason is not None:
                marks.append(pytest.mark.xfail(strict=(model.name, stages) not in MAY_PASS, reason=reason))
            cases.append(pytest.param(model, stages, marks=marks, id=f"{model.name}@{stages}"))
    return cases


@pytest.mark.parametrize("model,stages", _cases())
def test_zoo_model_partitions_and_matches_in_train_mode(tmp_path: Path, model: ZooModel, stages: int) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.partitioner import CostModel, plan_partition

    traced, source = _trace(model)
    plan = plan_partition(traced.profile, stages, microbatches=stages, time_limit=2.0,
                          cost=CostModel.preset("loopback", optimizer="sgd"))
    assert len(plan.stages) == stages
    build = tmp_path / "build"
    write_build_dir(traced, plan, build, source, batch_size=MICROBATCH * stages, microbatches=stages)
    result = compare_pipeline(build, source, training=True)
    assert result.ok, f"{model.name}@{stages}: {result.worst} off by {result.max_abs:.3g} ({result.failing} tensors)"
