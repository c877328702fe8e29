"""Shared data helpers of the zoo's model files (inputs, targets, losses, HF builders).

Only plain functions live here, never a module class that a traced graph could use: a
generated stage file imports its model file, and the model file finds this helper on
``sys.path`` (each model file puts its folder there), so classes stay in the model files.

Every helper is deterministic (seeded generators), as the model-file contract asks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ = 16
VOCAB = 96
IMAGE = 32
CHANNELS = 3
CLASSES = 10


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- token models -------------------------------------------------------------------------------------------------


def token_ids(batch_size: int, seq: int = SEQ, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    """``[B, seq]`` token ids (never 0, so no id collides with a pad token)."""
    return torch.randint(1, vocab, (batch_size, seq), generator=_gen(seed))


def padding_mask(batch_size: int, seq: int = SEQ) -> torch.Tensor:
    """``[B, seq]`` attention mask of ones whose last sample pads (right side) its final quarter."""
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    mask[-1, seq - seq // 4 :] = 0
    return mask


def next_token_targets(batch_size: int, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    """``[B, seq]`` targets for a causal LM: the inputs shifted left by one, the last position ignored (-100)."""
    ids = token_ids(batch_size, seq, vocab)
    return torch.cat([ids[:, 1:], torch.full((batch_size, 1), -100, dtype=ids.dtype)], dim=1)


def mlm_targets(batch_size: int, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    """``[B, seq]`` masked-LM targets: a random token at every fourth position, -100 elsewhere."""
    targets = torch.full((batch_size, seq), -100, dtype=torch.long)
    targets[:, ::4] = torch.randint(1, vocab, (batch_size, (seq + 3) // 4), generator=_gen(3))
    return targets


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: a ``ModelOutput``/dict's ``logits``, a tuple's first element, or a tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) or hasattr(output, "keys"):
        return output["logits"]
    return output[0]


def token_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the output's logits against ``[B, seq]`` targets (-100 ignored)."""
    logits = logits_of(output)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index=-100
    )


def lm_kwargs(batch_size: int, labels: bool = False, mask: bool = True) -> dict[str, torch.Tensor]:
    """The keyword call a Hugging Face training loop makes: ``input_ids``, ``attention_mask`` (and ``labels``)."""
    kwargs = {"input_ids": token_ids(batch_size)}
    if mask:
        kwargs["attention_mask"] = padding_mask(batch_size)
    if labels:
        kwargs["labels"] = token_ids(batch_size)  # HF causal LMs shift labels themselves
    return kwargs


def build_hf(config_cls: type, model_cls: type, seed: int = 0, **config: Any) -> nn.Module:
    """A randomly initialised transformers model from a tiny config (no download), KV cache off, train mode."""
    torch.manual_seed(seed)
    cfg = config_cls(use_cache=False, **config)
    model = model_cls(cfg)
    return model.train()


# ---- image models -------------------------------------------------------------------------------------------------


def images(batch_size: int, size: int = IMAGE, channels: int = CHANNELS) -> torch.Tensor:
    """``[B, C, size, size]`` standard-normal images."""
    return torch.randn(batch_size, channels, size, size, generator=_gen(1))


def class_targets(batch_size: int, classes: int = CLASSES) -> torch.Tensor:
    return torch.randint(0, classes, (batch_size,), generator=_gen(2))


def class_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the output's logits (a tensor or a ``ModelOutput``) against class indices."""
    return F.cross_entropy(logits_of(output), target)


def seeded(seed: int, factory: Any) -> nn.Module:
    """``factory()`` built under a fixed seed (deterministic initial weights), in train mode."""
    torch.manual_seed(seed)
    return factory().train()


def decoder_config(**overrides: Any) -> dict[str, Any]:
    """The tiny Llama-shaped hyperparameters most decoder configs share (4 layers, width 32, 4 heads, 2 KV heads)."""
    config: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.update(overrides)
    return config


def lm_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positional ``(input_ids, attention_mask)`` for models whose forward takes the mask second."""
    return token_ids(batch_size), padding_mask(batch_size)


def lm_kwargs_labels(batch_size: int) -> dict[str, torch.Tensor]:
    """``lm_kwargs`` plus ``labels=``: the model computes its own loss (``output.loss``)."""
    return lm_kwargs(batch_size, labels=True)


# ---- encoder-decoder models ---------------------------------------------------------------------------------------

TARGET_SEQ = 8


def seq2seq_targets(batch_size: int) -> torch.Tensor:
    """``[B, 8]`` target token ids of an encoder-decoder model."""
    return token_ids(batch_size, seq=TARGET_SEQ, seed=4)


def seq2seq_inputs(
    batch_size: int, decoder_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positional ``(input_ids, attention_mask, decoder_input_ids)``: the targets shifted right after the start token."""
    targets = seq2seq_targets(batch_size)
    decoder_ids = torch.cat(
        [torch.full_like(targets[:, :1], decoder_start), targets[:, :-1]], dim=1
    )
    return token_ids(batch_size), padding_mask(batch_size), decoder_ids


def seq2seq_kwargs(
    batch_size: int, decoder_start: int, labels: bool = False
) -> dict[str, torch.Tensor]:
    """The keyword call; with ``labels=`` the model shifts the labels into ``decoder_input_ids`` itself."""
    if labels:
        return {**lm_kwargs(batch_size), "labels": seq2seq_targets(batch_size)}
    ids, mask, decoder_ids = seq2seq_inputs(batch_size, decoder_start)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids}
