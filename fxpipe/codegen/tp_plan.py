"""The tensor-parallel plan of a build: which module of each stage is split how, found from the trace.

A stage module keeps the original model's module paths, and its forward is plain PyTorch,
so ``torch.fx`` can follow the data from one ``nn.Linear`` to the next. The rules
(Note [tensor-parallel rules]) pair column-parallel linears with the row-parallel linear
they feed through head-local or elementwise work: an MLP's ``fc -> act -> proj``, SwiGLU's
``gate, up -> silu * -> down``, attention's ``q, k, v -> heads -> o``. Every other linear,
and every embedding, stays replicated, each with the reason in the plan. The plan is data:
``tp_plan.json`` beside the manifest (``TensorParallelPlan.to_json``), printed in the
report, and a user may hand ``fxpipe run --tp-plan FILE`` an edited copy.

No ``torch.distributed`` here: ``fxpipe.runtime.pipeline.tensor_parallel`` applies a plan
with ``parallelize_module``.

Note [tensor-parallel rules]:
A row-parallel linear B is paired with the column-parallel linears A whose outputs reach
B's input through a region of operations that keep the split dimension local: elementwise
work, views into (heads, head_dim), transposes, attention (``scaled_dot_product_attention``,
``matmul``, ``softmax``), and operands from outside the region (masks, rotary tables), which
are replicated. A ``split`` or ``chunk`` of a projection's features (a fused ``qkv``) puts
features of one rank's rows into another's result, so such a pair stays replicated. The rules
decide only what is split, never whether the result is right: inside a region the runtime
computes on DTensors, whose global-shape semantics keep the emitted ``view(b, t, 4, 8)``
literal sizes valid and insert a collective wherever a placement needs one (Note
[DTensor regions] in ``fxpipe.runtime.pipeline.tensor_parallel``). A colwise linear followed
by a view to ``(..., head_dim)`` is an attention projection with ``out_features // head_dim``
heads: a degree T must divide the query heads (else the whole group stays replicated) and the
KV heads (else K and V stay replicated and each rank takes its query heads' share of them).

Note [vocabulary-parallel]:
Every ``nn.Embedding`` is split over its rows (its vocabulary: torch's
``RowwiseParallel(input_layouts=Replicate())``, the ids replicated, the output all-reduced to a
plain tensor), and on the last stage an unpaired linear whose output (the logits) reaches only
the stage's outputs and a plain cross entropy (through dtype casts, views keeping the last
dimension, slices of the other dimensions) is the LM head: ``ColwiseParallel`` with its logits
left sharded over the vocabulary (a DTensor), never gathered. The stage's own cross entropy
(a model called with ``labels=``) and a ``loss_fn`` that is a plain cross entropy then run under
torch's ``loss_parallel()`` (``fxpipe.runtime.pipeline.loss_parallel``); another ``loss_fn``
gets the logits gathered whole, as without tensor parallelism. A vocabulary that ``T`` does not
divide stays replicated. Tied weights (an embedding and its head, on one stage or across stages
by the manifest's ties) are split alike (rows of the same ``[vocab, hidden]`` weight) or not at
all: a tie whose every holder is not a vocabulary-parallel module stays replicated everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.codegen.tp_vocab import lm_heads, op_name, shared_weights
from fxpipe.errors import BuildDirError, ConfigError
from fxpipe.jsonio import check_schema_version, dump_json, load_json

__all__ = [
    "TP_PLAN_FILE",
    "SplitModule",
    "KeptWhole",
    "VocabSplit",
    "StageTPPlan",
    "TensorParallelPlan",
    "ResolvedStagePlan",
    "find_stage_plan",
    "find_tp_plan",
    "read_tp_plan",
    "write_tp_plan",
]

TP_PLAN_FILE = "tp_plan.json"
SCHEMA_VERSION = 1
STYLES = ("colwise", "rowwise")
VOCAB_KINDS = ("embedding", "head", "tied_head")
# what a vocabulary-parallel LM head's logits feed (Note [vocabulary-parallel])
HEAD_LOSSES = ("cross_entropy", "loss_fn")

# Operations that keep a split feature (or head) dimension local to its rank.
_REGION_OPS = {
    # elementwise
    "add", "sub", "mul", "truediv", "div", "neg", "pow", "exp", "sqrt", "rsqrt", "abs",
    "silu", "gelu", "relu", "tanh", "sigmoid", "dropout", "erf", "where", "masked_fill",
    "to", "float", "half", "bfloat16", "type", "contiguous", "clone", "type_as",
    # shape: views into heads, transposes, slices of head_dim, rotary cat
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand",
    "repeat_interleave", "flatten", "unflatten", "getitem", "cat", "size", "dim",
    # attention
    "scaled_dot_product_attention", "matmul", "bmm", "baddbmm", "softmax", "log_softmax",
    "mean", "float_power",
}  # fmt: skip
_ELEMENTWISE_MODULES = (
    nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.Mish,
    nn.LeakyReLU, nn.Softmax,
)  # fmt: skip


@dataclass(frozen=True)
class SplitModule:
    """One linear the plan splits: ``style`` colwise (output features) or rowwise (input
    features), ``group`` its pair (the rowwise linear's path), ``features`` the size of the
    split dimension, ``heads`` the attention heads of a projection (None outside attention),
    ``owner`` the module whose forward holds the pair ("" for the stage itself)."""

    path: str
    style: str
    group: str
    features: int
    heads: int | None = None
    owner: str = ""

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ConfigError(
                f"tensor-parallel style {self.style!r} of {self.path!r} is not one of {STYLES}"
            )


@dataclass(frozen=True)
class KeptWhole:
    """A linear or embedding no rule splits, and why: it stays replicated on every tp rank."""

    path: str
    reason: str


@dataclass(frozen=True)
class VocabSplit:
    """An embedding (``kind`` "embedding") or LM head ("head") split over its ``vocab`` rows
    (Note [vocabulary-parallel]), or the stage's ``F.linear`` over embedding ``path``'s weight
    ("tied_head": split with that embedding); a head's ``loss`` says what its logits feed: the
    stage's own cross entropy ("cross_entropy") or, as a model output, the ``loss_fn``
    ("loss_fn")."""

    path: str
    kind: str
    vocab: int
    loss: str = ""

    def __post_init__(self) -> None:
        head = self.kind != "embedding"
        if self.kind not in VOCAB_KINDS or head != (self.loss in HEAD_LOSSES):
            raise ConfigError(
                f"vocabulary-parallel {self.path!r}: kind {self.kind!r} is not one of "
                f"{VOCAB_KINDS}, or its loss {self.loss!r} is not one of {HEAD_LOSSES} (heads only)"
            )


@dataclass(frozen=True)
class ResolvedStagePlan:
    """A stage's plan at one degree: path -> style, the pairs split (by rowwise path), the modules
    holding them (``owners``), what stays replicated; ``head`` the vocabulary-parallel LM head
    ("" for none) and ``head_loss`` what its logits feed (Note [vocabulary-parallel])."""

    styles: dict[str, str]
    groups: tuple[str, ...]
    replicated: tuple[KeptWhole, ...]
    owners: tuple[str, ...] = ()
    head: str = ""
    head_loss: str = ""


@dataclass(frozen=True)
class StageTPPlan:
    """The split linears of one stage, and the linears and embeddings it keeps whole."""

    stage: int
    split: tuple[SplitModule, ...] = ()
    replicated: tuple[KeptWhole, ...] = ()
    vocab: tuple[VocabSplit, ...] = ()

    def for_degree(self, degree: int) -> ResolvedStagePlan:
        """The styles at tensor-parallel degree ``degree``: a group whose query heads or
        features ``degree`` does not divide stays replicated; KV projections whose heads it
        does not divide stay replicated alone (Note [tensor-parallel rules])."""
        kept = list(self.replicated)
        styles: dict[str, str] = {}
        groups: list[str] = []
        owners: list[str] = []
        by_group: dict[str, list[SplitModule]] = {}
        for m in self.split:
            by_group.setdefault(m.group, []).append(m)
        for group, members in by_group.items():
            rows = [m for m in members if m.style == "rowwise"]
            cols = [m for m in members if m.style == "colwise"]
            width = rows[0].features if rows else 0
            main = [m for m in cols if m.features == width]
            side = [m for m in cols if m.features != width]
            problem = _indivisible(rows + main, degree)
            if problem or not rows or not main:
                why = problem or "a colwise linear needs its rowwise pair"
                kept.extend(KeptWhole(m.path, why) for m in members)
                continue
            groups.append(group)
            if members[0].owner not in owners:
                owners.append(members[0].owner)
            for m in rows + main:
                styles[m.path] = m.style
            for m in side:
                side_problem = _indivisible([m], degree)
                if side_problem:
                    kept.append(KeptWhole(m.path, side_problem))
                else:
                    styles[m.path] = m.style
        head = head_loss = ""
        for v in self.vocab:
            if v.vocab % degree:
                kept.append(
                    KeptWhole(v.path, f"a vocabulary of {v.vocab} is not divisible by tp {degree}")
                )
                continue
            if v.kind != "tied_head":  # split as its embedding
                styles[v.path] = f"vocab_{v.kind}"
            if v.kind != "embedding":
                head, head_loss = v.path, v.loss
        return ResolvedStagePlan(styles, tuple(groups), tuple(kept), tuple(owners), head, head_loss)


def _indivisible(members: Iterable[SplitModule], degree: int) -> str:
    for m in members:
        if m.heads is not None and m.heads % degree:
            return f"{m.heads} heads of {m.path} are not divisible by tp {degree}"
        if m.features % degree:
            return f"{m.features} features of {m.path} are not divisible by tp {degree}"
    return ""


@dataclass(frozen=True)
class TensorParallelPlan:
    """Every stage's plan, in stage order: ``tp_plan.json`` of a build."""

    stages: tuple[StageTPPlan, ...] = field(default_factory=tuple)

    def stage(self, index: int) -> StageTPPlan:
        for s in self.stages:
            if s.stage == index:
                return s
        return StageTPPlan(index)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "stages": [
                {
                    "stage": s.stage,
                    "split": [
                        {
                            "path": m.path,
                            "style": m.style,
                            "group": m.group,
                            "features": m.features,
                            "heads": m.heads,
                            "owner": m.owner,
                        }
                        for m in s.split
                    ],
                    "replicated": [{"path": k.path, "reason": k.reason} for k in s.replicated],
                    "vocab": [
                        {"path": v.path, "kind": v.kind, "vocab": v.vocab, "loss": v.loss}
                        for v in s.vocab
                    ],
                }
                for s in self.stages
            ],
        }

    def to_json(self, path: str | Path) -> None:
        dump_json(self.to_dict(), path, what="tensor-parallel plan", error=BuildDirError)

    @classmethod
    def from_json(cls, source: str | Path) -> TensorParallelPlan:
        """Read a plan (a build's ``tp_plan.json`` or a user's ``--tp-plan FILE``)."""
        what = "tensor-parallel plan"
        data = load_json(source, what, ConfigError)
        check_schema_version(data, SCHEMA_VERSION, what, ConfigError)
        try:
            stages = tuple(
                StageTPPlan(
                    int(s["stage"]),
                    tuple(
                        SplitModule(
                            str(m["path"]),
                            str(m["style"]),
                            str(m["group"]),
                            int(m["features"]),
                            None if m.get("heads") is None else int(m["heads"]),
                            str(m.get("owner", m["path"].rpartition(".")[0])),
                        )
                        for m in s.get("split", [])
                    ),
                    tuple(
                        KeptWhole(str(k["path"]), str(k.get("reason", "")))
                        for k in s.get("replicated", [])
                    ),
                    tuple(
                        VocabSplit(
                            str(v["path"]), str(v["kind"]), int(v["vocab"]), str(v.get("loss", ""))
                        )
                        for v in s.get("vocab", [])
                    ),
                )
                for s in data.get("stages", [])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{what} {str(source)[:200]!r} is malformed ({type(exc).__name__}: {exc}); each "
                'stage is {"stage": i, "split": [{"path", "style", "group", "features", "heads"}]}'
            ) from None
        return cls(stages)

    def summary(self, degree: int) -> list[str]:
        """One line per stage: what is split at ``degree`` and what stays replicated, and why."""
        lines = []
        for s in self.stages:
            r = s.for_degree(degree)
            cols = sum(1 for v in r.styles.values() if v == "colwise")
            rows = sum(1 for v in r.styles.values() if v == "rowwise")
            line = f"stage {s.stage}: {len(r.groups)} groups split ({cols} colwise, {rows} rowwise)"
            vocab = [p for p, v in r.styles.items() if v == "vocab_embedding"]
            if vocab:
                line += "; vocabulary-parallel embeddings: " + ", ".join(vocab)
            if r.head:
                head = r.head
                if r.styles.get(head) == "vocab_embedding":  # F.linear over a tied embedding
                    head = f"F.linear over {head}.weight"
                line += f"; vocabulary-parallel LM head: {head}, logits sharded, " + (
                    "the stage's cross entropy under loss_parallel"
                    if r.head_loss == "cross_entropy"
                    else "a loss_fn that is a plain cross entropy under loss_parallel, another "
                    "on gathered logits"
                )
            if r.replicated:
                line += "; replicated: " + "; ".join(f"{k.path} ({k.reason})" for k in r.replicated)
            lines.append(line)
        return lines


def read_tp_plan(build_dir: str | Path, override: str | Path | None = None) -> TensorParallelPlan:
    """``override`` when given, else the build's ``tp_plan.json``; a build without one (written
    before plans were, or whose stages could not be traced) is refused, never run unsplit."""
    if override is not None:
        return TensorParallelPlan.from_json(Path(override))
    path = Path(build_dir) / TP_PLAN_FILE
    if not path.is_file():
        raise ConfigError(
            f"build {str(build_dir)!r} has no {TP_PLAN_FILE} (fxpipe partition writes it); "
            "repartition, or pass --tp-plan FILE"
        )
    return TensorParallelPlan.from_json(path)


# -- finding the plan --------------------------------------------------------------------------


class _Tracer(fx.Tracer):
    """torch.nn's modules and the modules that failed to trace are leaves."""

    def __init__(self, opaque: set[int]) -> None:
        super().__init__()
        self.opaque = opaque

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.opaque or super().is_leaf_module(m, qualname)


def _head_dim(node: fx.Node) -> int | None:
    """The last size of a view or reshape of ``node`` into heads, if one is a literal."""
    for user in node.users:
        if op_name(user) in ("view", "reshape", "unflatten") and len(user.args) > 1:
            shape = user.args[1:] if op_name(user) != "unflatten" else user.args[2:]
            if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
                shape = tuple(shape[0])
            last = shape[-1] if shape else None
            if isinstance(last, int) and last > 0 and len(shape) >= 2:
                return last
    return None


def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def _pairs(
    gm: fx.GraphModule, linears: dict[str, nn.Linear], prefix: str
) -> tuple[list[SplitModule], list[KeptWhole]]:
    """The col -> row pairs in one traced module (Note [tensor-parallel rules])."""
    split: list[SplitModule] = []
    kept: list[KeptWhole] = []
    taken: set[str] = set()
    owner = prefix.rstrip(".")
    nodes = [
        n for n in gm.graph.nodes if n.op == "call_module" and prefix + str(n.target) in linears
    ]
    for row in nodes:
        row_path = prefix + str(row.target)
        if row_path in taken or not row.args or not isinstance(row.args[0], fx.Node):
            continue
        region: set[fx.Node] = set()
        sources: list[fx.Node] = []
        bad = ""
        stack = [row.args[0]]
        while stack:  # past a bad op too: the linears behind it are named with the reason
            n = stack.pop()
            if n in region or n in sources:
                continue
            if n.op == "call_module" and prefix + str(n.target) in linears:
                sources.append(n)
            elif n.op in ("placeholder", "get_attr"):
                continue
            elif n.op == "call_module":
                if isinstance(gm.get_submodule(str(n.target)), _ELEMENTWISE_MODULES):
                    region.add(n)
                    stack.extend(_inputs(n))
                else:
                    kind = type(gm.get_submodule(str(n.target))).__name__
                    bad = bad or f"{kind} between the linears"
                    region.add(n)
                    stack.extend(_inputs(n))
            elif n.op in ("call_function", "call_method") and op_name(n) in _REGION_OPS:
                region.add(n)
                stack.extend(_inputs(n))
            elif n.op in ("call_function", "call_method"):
                bad = bad or f"{op_name(n)!r} on the projected features"
                region.add(n)
                stack.extend(_inputs(n))
        if not sources:
            continue
        source_paths = [prefix + str(s.target) for s in sources]
        if not bad:
            for s in sources:
                if any(u not in region and u is not row for u in s.users):
                    bad = f"the output of {prefix + str(s.target)} is also used outside the pair"
        if not bad and any(p in taken for p in source_paths):
            continue  # its inputs pair with another linear: it may still be a colwise source
        if bad:
            for p in [*source_paths, row_path]:
                if p not in taken:
                    kept.append(KeptWhole(p, f"no rule fits: {bad}"))
                    taken.add(p)
            continue
        for s, p in zip(sources, source_paths):
            lin = linears[p]
            hd = _head_dim(s)
            heads = lin.out_features // hd if hd and lin.out_features % hd == 0 else None
            split.append(SplitModule(p, "colwise", row_path, lin.out_features, heads, owner))
            taken.add(p)
        split.append(
            SplitModule(row_path, "rowwise", row_path, linears[row_path].in_features, None, owner)
        )
        taken.add(row_path)
    return split, kept


def find_stage_plan(stage: nn.Module, index: int, last: bool = False) -> StageTPPlan:
    """The tensor-parallel plan of one stage module (Note [tensor-parallel rules]); ``last``: the
    stage that ends the model, where an LM head may be (Note [vocabulary-parallel]).

    Modules are traced innermost first; each linear belongs to the innermost traceable module
    where a rule pairs it. A module that cannot be traced becomes a leaf of its parents.
    """
    linears = {p: m for p, m in stage.named_modules() if isinstance(m, nn.Linear)}
    owners = [
        (p, m)
        for p, m in stage.named_modules()
        if not isinstance(m, nn.Linear)
        and not type(m).__module__.startswith("torch.nn")
        and any(q.startswith(p + "." if p else "") for q in linears)
    ]
    owners.sort(key=lambda pm: -(pm[0].count(".") + 1 if pm[0] else 0))  # innermost first
    split: list[SplitModule] = []
    kept: dict[str, KeptWhole] = {}
    done: set[str] = set()
    opaque: set[int] = set()
    failed: dict[str, str] = {}
    for path, module in owners:
        prefix = path + "." if path else ""
        mine = {q: m for q, m in linears.items() if q.startswith(prefix) and q not in done}
        if len(mine) < 2:
            continue
        try:
            graph = _Tracer(opaque).trace(module)
        except Exception as exc:  # any failure: this module is a leaf of its parents
            opaque.add(id(module))
            failed[path] = f"{type(module).__name__} could not be traced ({type(exc).__name__})"
            continue
        gm = fx.GraphModule(module, graph)
        found, whole = _pairs(gm, mine, prefix)
        split.extend(found)
        done.update(m.path for m in found)
        for k in whole:
            kept.setdefault(k.path, k)
    vocab: list[VocabSplit] = []
    embeddings = {p: m for p, m in stage.named_modules() if isinstance(m, nn.Embedding)}
    if last:
        unpaired = {q: m for q, m in linears.items() if q not in done and q not in kept}
        for q, (kind, loss) in lm_heads(stage, unpaired, embeddings).items():
            size = embeddings[q].num_embeddings if kind == "tied_head" else linears[q].out_features
            if loss in HEAD_LOSSES:
                vocab.append(VocabSplit(q, kind, size, loss))
            else:
                kept[q] = KeptWhole(q, loss)
    heads = {v.path for v in vocab}
    for q in linears:
        if q in done or q in kept or q in heads:
            continue
        owner = max((p for p in failed if q.startswith(p + ".")), key=len, default=None)
        why = failed[owner] if owner is not None else "no rule fits: no row-parallel pair"
        kept[q] = KeptWhole(q, why)
    for p, m in stage.named_modules():
        if p and not isinstance(m, (nn.Linear, nn.Embedding)):
            own = [n for n, w in m.named_parameters(recurse=False) if w.dim() >= 2]
            if own:  # fused experts (a Mixtral's [experts, out, in] weights), a router's weight
                why = f"{type(m).__name__} weights ({', '.join(own)}) used outside nn.Linear"
                kept[p] = KeptWhole(p, why + ": no rule splits them")
    for p, m in embeddings.items():
        if p not in kept:
            if m.max_norm is not None or m.sparse:
                kept[p] = KeptWhole(p, "an embedding with max_norm or sparse gradients")
            else:
                vocab.append(VocabSplit(p, "embedding", m.num_embeddings))
    plan = StageTPPlan(index, tuple(split), tuple(kept[k] for k in sorted(kept)), tuple(vocab))
    return _untie(plan, shared_weights(stage))


def _keep(plan: StageTPPlan, path: str, why: str) -> StageTPPlan:
    """``plan`` with the vocabulary-parallel module ``path`` replicated instead, for ``why``."""
    kept = {k.path: k for k in plan.replicated}
    kept[path] = KeptWhole(path, why)
    return StageTPPlan(
        plan.stage,
        plan.split,
        tuple(kept[k] for k in sorted(kept)),
        tuple(v for v in plan.vocab if v.path != path),
    )


def _untie(plan: StageTPPlan, tied: Iterable[Iterable[str]]) -> StageTPPlan:
    """``plan`` with each group of modules in ``tied`` (one tied weight) split over its vocabulary
    only if every holder is (Note [vocabulary-parallel]); the others keep it replicated."""
    for group in tied:
        vocab = {v.path: v.vocab for v in plan.vocab}
        members = list(group)
        whole = [m for m in members if m not in vocab]
        if not whole and len({vocab[m] for m in members}) <= 1:
            continue
        why = f"tied to {whole[0]}, which stays replicated" if whole else "tied weights differ"
        for m in members:
            if m in vocab:
                plan = _keep(plan, m, why)
    return plan


def find_tp_plan(
    stages: Iterable[nn.Module], ties: Iterable[Iterable[tuple[int, str]]] = ()
) -> TensorParallelPlan:
    """``find_stage_plan`` of each stage, in order, the last one holding the LM head; ``ties``: each
    weight several stages hold, as ``(stage, parameter key)`` pairs (the manifest's ties), split
    alike everywhere or nowhere (Note [vocabulary-parallel])."""
    modules = list(stages)
    plans = [find_stage_plan(s, i, last=i == len(modules) - 1) for i, s in enumerate(modules)]
    for tie in ties:
        holders = [(i, key.rpartition(".")[0]) for i, key in tie]
        split = {(i, v.path): v.vocab for i, _ in holders for v in plans[i].vocab}
        whole = [f"{p} on stage {i}" for i, p in holders if (i, p) not in split]
        if not whole and len({split[h] for h in holders}) <= 1:
            continue
        why = f"tied to {whole[0]}, which stays replicated" if whole else "tied weights differ"
        for i, p in holders:
            if (i, p) in split:
                plans[i] = _keep(plans[i], p, why)
    return TensorParallelPlan(tuple(plans))


def write_tp_plan(build_dir: str | Path, num_stages: int) -> TensorParallelPlan | None:
    """Find the plan of every stage of ``build_dir`` (built on the meta device: no weights are
    read) and write it as ``tp_plan.json``; a build whose stages cannot be loaded here gets no
    plan (warned: ``fxpipe run --tp`` then needs ``--tp-plan``)."""
    import warnings

    from fxpipe.codegen.integrity import check_build, model_import_needed
    from fxpipe.codegen.load import _stage_class, forget_stage_modules, read_manifest

    try:
        manifest = read_manifest(build_dir)
        indices = list(range(num_stages))
        build = check_build(
            build_dir,
            indices,
            model=model_import_needed(manifest, indices),
            plan=False,
            manifest=manifest,
        )
        stages = []
        for i in indices:
            with torch.device("meta"):  # the structure only: no weights are read
                stages.append(_stage_class(build, i)())
        plan = find_tp_plan(stages, [list(zip(t.stages, t.keys)) for t in manifest.ties])
    except Exception as exc:  # the plan is an extra: never fail the build over it
        warnings.warn(
            f"fxpipe: no tensor-parallel plan written ({type(exc).__name__}: {exc})", stacklevel=2
        )
        return None
    finally:  # the stages were imported from the staging folder: never reuse those modules
        forget_stage_modules(build_dir)
    plan.to_json(Path(build_dir) / TP_PLAN_FILE)
    return plan
