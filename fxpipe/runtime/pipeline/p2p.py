"""Point-to-point transfers between stages with ``dist.batch_isend_irecv``.

Every message has a tag unique per (microbatch, transfer, direction), so gloo can never
match a message with the wrong receive. A failed or timed-out wait becomes a
``PeerError`` that names this rank, the peer and what was being waited for; those words
are only put together on failure, so a step formats no text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxpipe.errors import PeerError

__all__ = ["Message", "P2P", "peer_error"]


@dataclass(frozen=True)
class Message:
    """One tensor to send to, or receive from, stage ``peer_stage``; ``what`` names it for errors
    (``microbatch`` >= 0 is put in front: "microbatch 3 activation 'h1'")."""

    tensor: torch.Tensor
    peer_stage: int
    tag: int
    what: str
    microbatch: int = -1

    def describe(self) -> str:
        return self.what if self.microbatch < 0 else f"microbatch {self.microbatch} {self.what}"


def peer_error(exc: BaseException, rank: int, doing: str, timeout_s: float) -> PeerError:
    """Turn a communication failure into an actionable ``PeerError``."""
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        cause = (
            f"no answer within the {timeout_s:g} s timeout; the peer is stuck or slow "
            f"(raise timeout_s / --timeout if its step is legitimately longer)"
        )
    elif (
        "closed by peer" in text
        or "reset by peer" in text
        or "Connection" in text
        or "Broken pipe" in text
    ):
        cause = "the peer closed the connection: it probably crashed or exited; see its log for the first error"
    else:
        cause = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return PeerError(f"rank {rank}: {doing} failed: {cause}")


class P2P:
    """Sends and receives between the stages of one pipeline replica.

    ``stage_ranks[s]`` is the global rank of stage ``s`` in this replica.
    """

    def __init__(
        self,
        rank: int,
        stage_ranks: Sequence[int],
        timeout_s: float,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.stage_ranks = tuple(stage_ranks)
        self.timeout_s = timeout_s
        self.group = group

    def _describe(self, m: Message, sending: bool) -> str:
        return (
            f"{'sending' if sending else 'receiving'} {m.describe()} {'to' if sending else 'from'} stage "
            f"{m.peer_stage} (rank {self.stage_ranks[m.peer_stage]})"
        )

    def post(
        self, sends: Sequence[Message], recvs: Sequence[Message]
    ) -> list[tuple[dist.Work, Message, bool]]:
        """Post all sends and receives as one batch; returns (work, message, is a send) triples."""
        ops = [
            dist.P2POp(dist.isend, m.tensor, self.stage_ranks[m.peer_stage], self.group, m.tag)
            for m in sends
        ]
        ops += [
            dist.P2POp(dist.irecv, m.tensor, self.stage_ranks[m.peer_stage], self.group, m.tag)
            for m in recvs
        ]
        if not ops:
            return []
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            first = sends[0] if sends else recvs[0]
            raise peer_error(
                exc, self.rank, self._describe(first, bool(sends)), self.timeout_s
            ) from exc
        flags = [True] * len(sends) + [False] * len(recvs)
        return list(zip(works, [*sends, *recvs], flags))

    def wait(self, pending: Sequence[tuple[dist.Work, Message, bool]]) -> None:
        """Wait for posted operations, turning failures into ``PeerError``."""
        for work, message, sending in pending:
            try:
                work.wait()
            except RuntimeError as exc:
                raise peer_error(
                    exc, self.rank, self._describe(message, sending), self.timeout_s
                ) from exc
