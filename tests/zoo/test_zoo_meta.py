"""Every zoo model traced on the meta device gives the profile its real-tensor trace gives (issue 12).

FLOPs, parameter, buffer, activation and output bytes and the units' ops are equal, times within 1%
(``assert_same_profile`` of tests/tracer/test_meta_trace.py). Two models read tensor values on the
way: Mixtral's experts call a kernel whose meta version refuses fp32 (``aten._grouped_mm``), and
``nn.TransformerEncoder`` asks whether its padding mask is left-aligned
(``aten._nested_tensor_from_mask_left_aligned``); the CTC heads (Wav2Vec2, HuBERT) check their
labels' values (``labels.max() >= vocab_size``), which the model's own run on meta cannot read
(on real tensors the check is kept as a runtime assert: Note [checks on data]). Tracing those on
meta is one ``TraceError`` line
that names the op and says to trace with real tensors. The quick run takes Falcon, whose attention builds a tensor constant
(``lift_fresh``, dispatched on real tensors only); ``FXPIPE_ZOO=full`` (``make zoo``) takes every model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "tracer"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from registry import zoo_models  # noqa: E402
from test_meta_trace import _trace, assert_same_profile  # noqa: E402
from test_zoo import FULL  # noqa: E402

from fxpipe.errors import TraceError  # noqa: E402

CANNOT_RUN_ON_META = {"mixtral", "transformer_encoder", "wav2vec2_ctc", "hubert_ctc"}
MODELS = [m for m in zoo_models() if m.model_fn == "build_model" and (FULL or m.name == "falcon")]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_meta_profile_equals_real(model) -> None:
    if model.name in CANNOT_RUN_ON_META:
        with pytest.raises(TraceError, match="cannot run.*trace with real tensors"):
            _trace(model.path, trace_device="meta")
        return
    assert_same_profile(_trace(model.path).profile, _trace(model.path, trace_device="meta").profile)
