"""Finding a stage's LM heads and shared weights, for the vocabulary-parallel part of a tp plan.

Note [vocabulary-parallel] in ``fxpipe.codegen.tp_plan`` says what is split; here the stage's own
forward is traced (every submodule a leaf) to find the linears (or ``F.linear`` over an embedding's
weight) whose logits reach only its outputs and a plain cross entropy, and the weights several of
its modules share (ties the plan splits alike or not at all). No ``torch.distributed`` here.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
import torch.nn as nn

__all__ = ["lm_heads", "op_name", "shared_weights"]


def op_name(node: fx.Node) -> str:
    """The name of ``node``'s operation: a method's, a function's (``getitem``), an op overload's."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    return name.strip("_")


_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as", "contiguous", "clone"}


def _cross_entropy_input(user: fx.Node, node: fx.Node) -> str:
    """ "" when ``user`` is a plain cross entropy of ``node`` (its input, no label smoothing),
    else why not; "not" when ``user`` is no cross entropy."""
    name = op_name(user).partition(".")[0]  # aten's overloads: cross_entropy_loss.default
    if user.op != "call_function" or name not in ("cross_entropy", "cross_entropy_loss"):
        return "not"
    if not user.args or user.args[0] is not node or node in user.args[1:]:
        return "the logits are not the cross entropy's input alone"
    smoothing_at = 5 if name == "cross_entropy_loss" else 7  # aten's and F.cross_entropy's
    smoothing = user.kwargs.get(
        "label_smoothing", user.args[smoothing_at] if len(user.args) > smoothing_at else 0.0
    )
    return "" if smoothing in (0, 0.0, None) else "a cross entropy with label smoothing"


def _logits_use(head: fx.Node, vocab: int) -> str:
    """What the logits of ``head`` feed: "cross_entropy", "loss_fn" (stage outputs only), or
    why loss_parallel cannot take them; "" when they reach neither an output nor a loss."""
    stack, seen = [head], set()
    loss, reached, why = "loss_fn", False, ""
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            name = op_name(user)
            if user.op == "output":
                reached = True
            elif (ce := _cross_entropy_input(user, n)) != "not":
                reached, loss = True, "cross_entropy"
                why = why or ce
            elif name == "size" or name in _CASTS:
                if name != "size":
                    stack.append(user)
            elif name in ("view", "reshape") and len(user.args) > 1:
                shape = user.args[1:]
                if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
                    shape = tuple(shape[0])
                if shape and shape[-1] == vocab:
                    stack.append(user)
                else:
                    why = why or f"a {name} of the logits that moves the vocabulary dimension"
            elif name == "getitem" and _keeps_last(user.args[1] if len(user.args) > 1 else None):
                stack.append(user)
            else:
                why = why or f"{name!r} on the logits"
    if not reached:
        return ""
    if why:
        return f"an LM head whose {why}: loss_parallel takes a plain cross entropy"
    return loss


def _keeps_last(index: Any) -> bool:
    """An index that slices only dimensions before the last (``x[:, :-1, :]``)."""
    return (
        isinstance(index, tuple)
        and len(index) > 0
        and index[-1] == slice(None)
        and all(i is not Ellipsis for i in index[:-1])
    )


def lm_heads(
    stage: nn.Module, linears: dict[str, nn.Linear], embeddings: dict[str, nn.Embedding]
) -> dict[str, tuple[str, str]]:
    """The LM heads of the stage's own forward (Note [vocabulary-parallel]): its unpaired linears,
    and its ``F.linear`` over an embedding's weight (a tied head the emitter wrote as a call),
    whose logits reach the stage's outputs: path -> (kind, what they feed (``HEAD_LOSSES``) or
    why not)."""

    class _Root(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return True

    try:
        graph = _Root().trace(stage)
    except Exception:  # a stage the tracer cannot follow keeps its linears replicated
        return {}
    found: dict[str, tuple[str, str]] = {}
    for node in graph.nodes:
        path, kind, vocab = str(node.target), "head", 0
        if node.op == "call_module" and path in linears:
            vocab = linears[path].out_features
        elif node.op == "call_function" and op_name(node) == "linear" and len(node.args) > 1:
            weight = node.args[1]
            path = str(weight.target).rpartition(".")[0] if isinstance(weight, fx.Node) else ""
            if isinstance(weight, fx.Node) and weight.op == "get_attr" and path in embeddings:
                kind, vocab = "tied_head", embeddings[path].num_embeddings
        if vocab and path not in found and (use := _logits_use(node, vocab)):
            found[path] = (kind, use)
    return found


def shared_weights(stage: nn.Module) -> list[list[str]]:
    """The module paths of each parameter several modules of ``stage`` hold (tied weights)."""
    holders: dict[int, list[str]] = {}
    for p, m in stage.named_modules(remove_duplicate=False):
        for name, param in m.named_parameters(recurse=False):
            if p not in holders.setdefault(id(param), []):
                holders[id(param)].append(p)
    return [h for h in holders.values() if len(h) > 1]
