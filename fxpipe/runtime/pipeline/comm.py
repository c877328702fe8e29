"""``RankComm``: one rank's messages of a step: remote receives and sends, local hand-offs, reused buffers.

Note [posting messages]: a rank's stages exchange tensors three ways.

* Stages on the same rank (interleaved and V-shaped schedules) hand tensors over in
  memory (``put_local`` / ``take_local``): no copy and no message.
* Receives from other ranks land in buffers taken from a pool per (transfer,
  direction, shape) and given back when the microbatch no longer needs them
  (``release``), so a step allocates no receive buffer once the pools are warm.
* Sends are posted and never waited for until ``finish`` at the end of the step.
  With ``pair_sends`` (NCCL) an action's sends are held back and posted in one batch
  with the next receives, so every pair of neighbours posts matching groups and no
  stream blocks on a receive whose send sits behind it. Without it (gloo, whose
  transfers progress on their own threads), sends go out at once and the executor
  posts every receive of the step when the step starts (``fxpipe.runtime.pipeline.executor``).
  Gloo moves a message from the sender's own call only when the receiver announced its
  receive before the send; otherwise the sender's transport thread must wake to move it,
  and while the sender computes that thread waits for a core, up to a scheduler time
  slice (measured: Note [message stalls] in ``fxpipe.partitioner.schedule.sharing``).
  The price is one receive buffer per message of the step, which the memory prediction
  counts (Note [memory over time]).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.runtime.pipeline.groups import backend_for
from fxpipe.runtime.pipeline.p2p import P2P, Message

__all__ = ["RankComm", "Posted", "pairs_sends"]

Posted = list[tuple[dist.Work, Message, bool]]


def pairs_sends(device: torch.device) -> bool:
    """Whether a rank on ``device`` pairs its sends with receives (NCCL) or posts every receive
    of a step when the step starts (gloo). The memory prediction counts receive buffers and
    the step simulation prices posting by the same fact (``RuntimeCosts.step_receives``; a
    test keeps the two in step)."""
    return backend_for(device) == "nccl"


class RankComm:
    """Messages, local hand-offs and receive buffers of one rank (Note [posting messages])."""

    def __init__(self, p2p: P2P, device: torch.device, pair_sends: bool) -> None:
        self.p2p = p2p
        self.device = device
        self.pair_sends = pair_sends
        self._pending: list[Message] = []  # sends held back to go out with the next receives
        self._in_flight: Posted = []  # posted sends, waited for in finish()
        self._local: dict[tuple[int, int, bool], torch.Tensor] = {}
        self._pools: dict[Any, list[torch.Tensor]] = defaultdict(list)

    # -- buffers ---------------------------------------------------------------

    def buffer(self, key: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer for ``key`` (a transfer and direction) of this shape, reused when one is free."""
        pool = self._pools[(key, shape, dtype)]
        return pool.pop() if pool else torch.empty(shape, dtype=dtype, device=self.device)

    def release(self, key: Any, buf: torch.Tensor) -> None:
        """Give ``buf`` back to its pool: the microbatch that used it is done with it."""
        self._pools[(key, tuple(buf.shape), buf.dtype)].append(buf)

    def pooled(self) -> list[torch.Tensor]:
        """The receive buffers in the pools now (between steps: all of them), for memory accounting."""
        return [buf for pool in self._pools.values() for buf in pool]

    # -- local hand-offs -------------------------------------------------------

    def put_local(
        self, transfer: int, microbatch: int, gradient: bool, tensor: torch.Tensor
    ) -> None:
        self._local[(transfer, microbatch, gradient)] = tensor

    def take_local(self, transfer: int, microbatch: int, gradient: bool) -> torch.Tensor:
        return self._local.pop((transfer, microbatch, gradient))

    # -- messages --------------------------------------------------------------

    def post_recvs(self, recvs: list[Message]) -> Posted:
        """Post ``recvs`` (with any held-back sends); the receives' handles, to ``wait`` on."""
        sends, self._pending = self._pending, []
        if not sends and not recvs:
            return []
        posted = self.p2p.post(sends, recvs)
        self._in_flight += posted[: len(sends)]
        return posted[len(sends) :]

    def wait(self, posted: Posted) -> None:
        if posted:
            self.p2p.wait(posted)

    def send(self, sends: list[Message]) -> None:
        """Send without waiting: now, or with the next receives under ``pair_sends``."""
        if not sends:
            return
        if self.pair_sends:
            self._pending += sends
        else:
            self._in_flight += self.p2p.post(sends, [])

    def finish(self) -> None:
        """Post the held-back sends and wait for every send of the step."""
        in_flight = self._in_flight + (self.p2p.post(self._pending, []) if self._pending else [])
        self._pending, self._in_flight = [], []
        self.p2p.wait(in_flight)
        self._local.clear()
