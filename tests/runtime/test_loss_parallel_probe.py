"""Which losses run on vocabulary-sharded logits under loss_parallel (Note [which losses run in
parallel] in fxpipe.runtime.pipeline.loss_parallel): the probe on meta copies, in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fxpipe.runtime.pipeline.loss_parallel import cross_entropy_only

V = 12


def _probe(loss_fn: Any, output: Any = None) -> str:
    logits = torch.randn(2, 5, V) if output is None else output
    target = torch.randint(0, V, (2, 5))
    found = [logits] if isinstance(logits, torch.Tensor) else [logits["logits"]]
    return cross_entropy_only(loss_fn, logits, target, found)


def flat(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # the GPT example's
    return F.cross_entropy(out.reshape(-1, out.size(-1)), t.reshape(-1))


def hf_style(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # transformers' causal LM loss
    labels = F.pad(t, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(out.float().view(-1, V), labels.reshape(-1), reduction="sum") / 7


def shifted(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # logits sliced, not the vocab
    return F.cross_entropy(out[:, :-1, :].reshape(-1, V), t[:, 1:].reshape(-1), ignore_index=3)


def nll(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.nll_loss(F.log_softmax(out, -1).view(-1, V), t.view(-1))


@pytest.mark.parametrize("loss_fn", [flat, hf_style, shifted, nll])
def test_plain_cross_entropies_run_on_sharded_logits(loss_fn: Any) -> None:
    assert _probe(loss_fn) == ""


def test_a_model_output_mapping_is_followed() -> None:
    def of_dict(out: dict, t: torch.Tensor) -> torch.Tensor:
        return flat(out["logits"], t)

    assert _probe(of_dict, {"logits": torch.randn(2, 5, V), "other": torch.ones(3)}) == ""


@pytest.mark.parametrize(
    ("loss_fn", "why"),
    [
        (lambda o, t: flat(o, t) + 0.1 * o.logsumexp(-1).mean(), "on the logits"),
        (
            lambda o, t: F.cross_entropy(o.view(-1, V), t.view(-1), label_smoothing=0.1),
            "log_softmax of the logits feeds",
        ),
        (lambda o, t: F.cross_entropy(o.transpose(1, 2), t), "on the logits"),
        (lambda o, t: (o.softmax(-1) - 0.5).pow(2).mean(), "on the logits"),
        (lambda o, t: F.cross_entropy(o[..., :6].reshape(-1, 6), t.view(-1) % 6), "vocabulary"),
        (lambda o, t: F.mse_loss(o, torch.zeros_like(o)), "on the logits"),
        (lambda o, t: torch.tensor(float(o.sum())), "failed on meta tensors"),
    ],
)
def test_other_losses_get_gathered_logits_and_say_why(loss_fn: Any, why: str) -> None:
    assert why in _probe(loss_fn)
