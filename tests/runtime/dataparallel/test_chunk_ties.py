"""A parameter tied between a rank's chunks: one copy per chunk, gradients summed (no process group)."""

from __future__ import annotations

import torch
import torch.nn as nn

from fxpipe.runtime.dataparallel.chunk_ties import TiedCopies, untie_chunks


def _chunks() -> tuple[nn.Module, nn.Module, nn.Parameter]:
    shared = nn.Parameter(torch.randn(3, 2))
    a, b = nn.Module(), nn.Module()
    a.emb = nn.Module()
    a.emb.weight = shared
    b.head, b.proj = nn.Module(), nn.Module()
    b.head.weight = shared
    b.proj.weight = shared  # held twice by the second chunk
    b.own = nn.Parameter(torch.ones(2))
    return a, b, shared


def test_each_chunk_gets_one_equal_copy_and_the_copies_share_their_summed_gradient() -> None:
    a, b, shared = _chunks()
    ties = untie_chunks([a, b])
    assert len(ties) == 1 and len(ties[0]) == 2  # the original and the second chunk's one copy
    assert a.emb.weight is shared and b.head.weight is b.proj.weight and b.head.weight is not shared
    assert torch.equal(b.head.weight, shared)
    a.emb.weight.grad, b.head.weight.grad = torch.full((3, 2), 1.0), torch.full((3, 2), 2.0)
    copies = TiedCopies(ties)
    copies.share_grads()
    assert (
        a.emb.weight.grad is b.head.weight.grad
    )  # one tensor, so a cross-rank all-reduce reaches both
    torch.testing.assert_close(a.emb.weight.grad, torch.full((3, 2), 3.0))
    copies.own_grads()
    assert a.emb.weight.grad is not b.head.weight.grad
    torch.testing.assert_close(b.head.weight.grad, torch.full((3, 2), 3.0))


def test_a_copy_without_gradient_takes_the_others_and_untied_chunks_are_left_alone() -> None:
    a, b, _ = _chunks()
    copies = TiedCopies(untie_chunks([a, b]))
    b.head.weight.grad = torch.full((3, 2), 2.0)
    copies.share_grads()
    torch.testing.assert_close(a.emb.weight.grad, torch.full((3, 2), 2.0))
    c = nn.Linear(2, 2)
    assert untie_chunks([c, nn.Linear(2, 2)]) == [] and untie_chunks([c]) == []
