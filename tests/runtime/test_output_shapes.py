"""A stage's outputs are checked once per microbatch, before any is sent or handed on.

``StageWorker.forward`` checks every output against the manifest (``BoundaryTensor.has_shape``):
an output a stage of another rank receives is named from the receiver's side, any other (a model
output, a tensor for a stage of this rank) from the manifest's; a data-dependent dimension
(``"?"``) takes any size, its other dimensions their formula. One process, no messages: a P2P
that records what it is asked to post.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import handmade
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.pipeline.routes import routes_from_manifest
from fxpipe.runtime.pipeline.stage_io import StageWorker

MB = handmade.TRACED_MB


class _Recording:
    """A P2P that posts nothing and records what it was given."""

    def __init__(self) -> None:
        self.posted: list[object] = []

    def post(self, sends: list, recvs: list) -> list:
        self.posted += [*sends, *recvs]
        return []

    def wait(self, pending: list) -> None:
        pass


class _Returns(nn.Module):
    """A stage module that returns ``outputs`` whatever it is given."""

    def __init__(self, *outputs: torch.Tensor) -> None:
        super().__init__()
        self.outputs = outputs

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.outputs


def _worker(
    manifest: Manifest, stage: int, module: nn.Module, local: tuple[int, ...]
) -> tuple[StageWorker, _Recording]:
    p2p = _Recording()
    worker = StageWorker(
        manifest,
        routes_from_manifest(manifest),
        stage,
        module,
        p2p,  # type: ignore[arg-type]
        torch.device("cpu"),
        pair_sends=False,
        local_stages=local,
    )
    return worker, p2p


def _h0(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


def _keep() -> torch.Tensor:
    return torch.ones(MB, handmade.SEQ, dtype=torch.long)


def _last_stage(manifest: Manifest, logits: torch.Tensor) -> StageWorker:
    """Stage 2 with its inputs handed over in memory (all stages on this rank)."""
    worker, _ = _worker(manifest, 2, _Returns(logits), (0, 1, 2))
    routes = routes_from_manifest(manifest)
    for t in routes.recvs(2):
        shape = t.spec.shape_at(MB, MB)
        worker.comm.put_local(t.tensor_id, 0, False, torch.zeros(shape, requires_grad=t.grad))
    return worker


def test_an_output_sent_to_another_rank_is_refused_before_any_message() -> None:
    idx = torch.zeros(MB, handmade.SEQ, dtype=torch.long)
    worker, p2p = _worker(
        handmade.manifest(), 0, _Returns(_h0(MB, handmade.SEQ + 1, 8), _keep()), (0,)
    )
    with pytest.raises(
        RuntimeSetupError,
        match=r"stage 0 output 'h0' has shape \(2, 6, 8\) but its receiver expects \(2, 5, 8\) "
        r"\(formula \[2, 5, 8\] at microbatch size 2\).*--split-at\) or rebuild the directory",
    ):
        worker.forward(0, (idx,), MB)
    assert p2p.posted == []
    good, p2p = _worker(handmade.manifest(), 0, _Returns(_h0(MB, handmade.SEQ, 8), _keep()), (0,))
    good.forward(0, (idx,), MB)
    assert len(p2p.posted) == 3  # h0 to stages 1 and 2, keep to stage 1


def test_an_output_no_other_rank_receives_is_checked_against_the_manifest() -> None:
    idx = torch.zeros(MB, handmade.SEQ, dtype=torch.long)
    # stage 0 with its receivers on this rank: its tensors are handed over, not sent
    worker, p2p = _worker(
        handmade.manifest(), 0, _Returns(_h0(MB, handmade.SEQ, 7), _keep()), (0, 1, 2)
    )
    with pytest.raises(
        RuntimeSetupError,
        match=r"stage 0 output 'h0' has shape \(2, 5, 7\) but the manifest says \(2, 5, 8\) at "
        r"microbatch size 2; rebuild the directory",
    ):
        worker.forward(0, (idx,), MB)
    assert p2p.posted == [] and worker.comm._local == {}  # nothing handed over either
    # the model output of the last stage, which nothing receives
    scale = torch.ones(MB, 1, 1)
    wrong = torch.zeros(MB, handmade.SEQ, handmade.VOCAB + 1)
    with pytest.raises(
        RuntimeSetupError,
        match=r"output 'logits' has shape \(2, 5, 12\) but the manifest says \(2, 5, 11\)",
    ):
        _last_stage(handmade.manifest(), wrong).forward(0, (idx, scale), MB)
    right = torch.zeros(MB, handmade.SEQ, handmade.VOCAB)
    assert _last_stage(handmade.manifest(), right).forward(0, (idx, scale), MB)[0] is right


def _ragged_logits() -> Manifest:
    """The handmade build with a last-stage output whose middle dimension depends on the data."""
    m = handmade.manifest()
    logits = dataclasses.replace(m.stages[2].outputs[0], dims=("mb", "?", str(handmade.VOCAB)))
    stages = (*m.stages[:2], dataclasses.replace(m.stages[2], outputs=(logits,)))
    return dataclasses.replace(m, stages=stages)


def test_a_data_dependent_dimension_takes_any_size_and_the_others_their_formula() -> None:
    idx = torch.zeros(MB, handmade.SEQ, dtype=torch.long)
    scale = torch.ones(MB, 1, 1)
    for n in (1, 3, 9):  # any size along "?"
        out = torch.zeros(MB, n, handmade.VOCAB)
        assert _last_stage(_ragged_logits(), out).forward(0, (idx, scale), MB)[0] is out
    for bad in ((MB, 3, handmade.VOCAB + 1), (MB + 1, 3, handmade.VOCAB), (MB, handmade.VOCAB)):
        with pytest.raises(
            RuntimeSetupError,
            match=r"output 'logits' has shape .* but the manifest says \['mb', '\?', '11'\] at "
            r"microbatch size 2; rebuild the directory",
        ):
            _last_stage(_ragged_logits(), torch.zeros(bad)).forward(0, (idx, scale), MB)


def test_a_data_dependent_tensor_sent_away_is_named_from_its_receiver() -> None:
    m = handmade.manifest()
    h0 = dataclasses.replace(m.stages[0].outputs[0], dims=("mb", "?", str(handmade.WIDTH)))
    stages = (dataclasses.replace(m.stages[0], outputs=(h0, m.stages[0].outputs[1])), *m.stages[1:])
    ragged = dataclasses.replace(m, stages=stages)
    idx = torch.zeros(MB, handmade.SEQ, dtype=torch.long)
    worker, p2p = _worker(ragged, 0, _Returns(_h0(MB, 3, handmade.WIDTH + 1), _keep()), (0,))
    with pytest.raises(
        RuntimeSetupError,
        match=r"output 'h0' has shape \(2, 3, 9\) but its receiver expects \('mb', '\?', '8'\) "
        r"\(formula \['mb', '\?', '8'\] at microbatch size 2\)",
    ):
        worker.forward(0, (idx,), MB)
    assert p2p.posted == []
    worker, p2p = _worker(ragged, 0, _Returns(_h0(MB, 3, handmade.WIDTH), _keep()), (0,))
    worker.forward(0, (idx,), MB)
    assert len(p2p.posted) == 5  # h0's shape and h0 to stages 1 and 2, keep to stage 1
