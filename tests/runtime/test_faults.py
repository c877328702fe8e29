"""Failures end the job with clear errors instead of a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import handmade
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime import PipelineRunner
from spawn import spawn

TIMEOUT_S = 4.0


class _Faulty(nn.Module):
    """Wraps a stage; misbehaves on its ``at``-th forward call."""

    def __init__(self, inner: nn.Module, mode: str, at: int) -> None:
        super().__init__()
        self.inner, self.mode, self.at, self.calls = inner, mode, at, 0

    def forward(self, *args: torch.Tensor):
        self.calls += 1
        if self.calls == self.at:
            if self.mode == "raise":
                raise ValueError("boom in stage 1")
            if self.mode == "exit":
                os._exit(7)
            if self.mode == "hang":
                time.sleep(TIMEOUT_S + 2)
                raise ValueError("woke up too late")
        return self.inner(*args)


def _fault_job(rank: int, world: int, mode: str) -> None:
    load = handmade.stage_loader()

    def loader(index: int, device: torch.device) -> nn.Module:
        stage = load(index, device)
        return _Faulty(stage, mode, at=3) if index == 1 else stage

    runner = PipelineRunner(
        handmade.manifest(),
        handmade.loss_fn,
        stage_loader=loader,
        microbatches=2,
        timeout_s=TIMEOUT_S,
    )
    inputs, target = handmade.example_batch(4)
    for _ in range(3):
        runner.step(inputs, target)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["raise", "exit", "hang"])
def test_a_failing_rank_makes_the_others_fail_with_peer_error(mode: str) -> None:
    results = spawn(_fault_job, 3, mode, timeout=60, expect_failure=True)
    assert not any(r.ok for r in results)
    culprit, others = results[1], [results[0], results[2]]
    if mode == "raise":
        assert "boom in stage 1" in culprit.error
    elif mode == "exit":
        assert "exited with code 7" in culprit.error
    for r in others:
        assert r.error.startswith("PeerError: rank "), r.error
        assert "failed:" in r.error
        assert "closed the connection" in r.error or "no answer within" in r.error
        assert (
            r.seconds < 2 * TIMEOUT_S + 10
        )  # ended by the failure or the timeout, not by the harness
    if mode == "hang":  # the hung rank is alive, so whoever waits on it directly times out
        assert any(f"no answer within the {TIMEOUT_S:g} s timeout" in r.error for r in others)


def test_world_size_mismatch_is_refused_before_any_communication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv(
        "MASTER_PORT", "1"
    )  # nothing listens: any communication would fail differently
    with pytest.raises(
        RuntimeSetupError, match=r"world size 2 does not match the build directory's 3 stages"
    ):
        PipelineRunner(handmade.manifest(), handmade.loss_fn, stage_loader=handmade.stage_loader())
    assert not dist.is_initialized()


def test_missing_torchrun_environment_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeSetupError, match="RANK is not set: start the workers with torchrun"):
        PipelineRunner(handmade.manifest(), handmade.loss_fn, stage_loader=handmade.stage_loader())
