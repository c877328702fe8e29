"""The conformance zoo partitions and equals the original in TRAIN and EVAL mode (issue 10).

Every zoo model (``registry.py``) is traced with the default front end and cut into 2 stages
(and 4 for ``FOUR_STAGES``) the way ``fxpipe partition`` does it: ``write_build_dir`` runs the
compiler's safety net (both modes, at the traced microbatch) before it writes the build. Then
``fxpipe verify``'s check (:func:`fxpipe.codegen.verify_build`) rebuilds the model from its file,
gives it the build's weights and compares it with the chained stages at the build's batch size,
in train and in eval mode: outputs, every parameter gradient, every buffer, fp32, rtol 1e-4 /
atol 1e-5. Both are :func:`fxpipe.codegen.check.equivalence.compare_in_mode`; the zoo adds no
comparison of its own.

The model files of ``outside/`` (other configs of the same families, written as a new user
would: GPT-2 with an untied head, multi-query Llama, T5 v1.1, ALBERT, Swin, a ResNeXt, ...) run
the same check at 2 stages.

The default run takes ``QUICK`` (one model per kind of fix, 2 stages, about a minute); the whole zoo
runs with ``FXPIPE_ZOO=full`` (``make zoo``). A case that fails today would be a strict xfail in
``KNOWN`` with its precise reason, and leave the list once fixed.
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

from registry import ZooModel, outside_models, zoo_models  # noqa: E402

FULL = os.environ.get("FXPIPE_ZOO") == "full"
MICROBATCH = 2
QUICK = {
    "regnet",
    "vit_mha",
    "transformer_encoder",
    "bloom",
}  # in-place ops + BN, MHA, auto -> export, HF
FOUR_STAGES = {
    "resnet18",
    "densenet",
    "efficientnet",
    "googlenet",
    "vit_mha",
    "transformer_encoder",
    "llama",
    "mixtral",
    "t5",
    "bart",
    "gpt2",
    "falcon",
    "vit_timm",
    "convnext",
    "phi3",
    "dict_batch",
    "dataclass_batch",
    "whisper",
    "llama_lora",
    "wav2vec2_ctc",
    "hubert_ctc",
    "clip",
    "siglip",
    "chinese_clip",
    "mamba",
    "mamba2",
}  # issue 37: frozen parameters, checks on data, a batch the model fixes, containers, state-space
KNOWN: dict[
    tuple[str, int | None], str
] = {}  # (model, stages or None for all) -> why it fails today

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
                marks.append(
                    pytest.mark.skip(reason="the whole zoo runs with FXPIPE_ZOO=full (make zoo)")
                )
            reason = KNOWN.get((model.name, stages)) or KNOWN.get((model.name, None))
            if reason is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            cases.append(pytest.param(model, stages, marks=marks, id=f"{model.name}@{stages}"))
    full_only = pytest.mark.skipif(
        not FULL, reason="the whole zoo runs with FXPIPE_ZOO=full (make zoo)"
    )
    cases += [
        pytest.param(model, 2, marks=[pytest.mark.slow, full_only], id=f"outside/{model.name}@2")
        for model in outside_models()
    ]
    return cases


@pytest.mark.parametrize("model,stages", _cases())
def test_zoo_model_partitions_and_matches_in_train_and_eval_mode(
    tmp_path: Path, model: ZooModel, stages: int
) -> None:
    from fxpipe.codegen import verify_build, write_build_dir
    from fxpipe.partitioner import CostModel, plan_partition

    traced, source = _trace(model)
    plan = plan_partition(
        traced.profile,
        stages,
        microbatches=stages,
        time_limit=2.0,
        cost=CostModel.preset("loopback", optimizer="sgd"),
    )
    assert len(plan.stages) == stages
    build = tmp_path / "build"
    write_build_dir(
        traced, plan, build, source, batch_size=MICROBATCH * stages, microbatches=stages
    )  # safety net
    report = verify_build(build)
    assert [m.training for m in report.modes] == [True, False]
    assert report.ok, f"{model.name}@{stages}:\n{report.summary()}\nworst: {report.worst}"
