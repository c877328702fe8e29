"""Render a build's stages as readable Python files: generated functions and module classes, then each stage's
``nn.Module``; what several stages use goes once into ``shared.py``.

The stage graph is first written the way people write PyTorch (Note [exact operator
rewrites] in :mod:`fxpipe.codegen.render.operators`; Note [identity conversions] in
:mod:`fxpipe.codegen.graph.aliases`), then given its module structure back (Note [outlining module
calls] in :mod:`fxpipe.codegen.graph.outline`): each whole module call becomes a submodule call,
identical blocks share one generated class (Note [one class per distinct body] in
:mod:`fxpipe.codegen.render.classes`), ``torch.nn`` layers appear as themselves, and a line that
called a helper function calls a generated one (Note [helper calls] in
:mod:`fxpipe.codegen.render.functions`). Values take the names the source gave them (Note [names
from the source] in :mod:`fxpipe.codegen.render.statements`). ``__init__`` builds exactly what the
stage owns under the original module paths, so its ``state_dict()`` keys are the original
model's. ``forward`` drops a value after its last use (``x = None``) where that lowers its
peak memory (Note [frees that matter] in :mod:`fxpipe.codegen.render.frees`). A class or function
that several stages use is written once, into ``shared.py`` (Note [classes several stages
share] in :mod:`fxpipe.codegen.shared`).
"""

from __future__ import annotations

import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch.fx as fx
import torch.nn as nn

from fxpipe.codegen.graph.aliases import (
    drop_metadata_asserts,
    drop_unused_pure,
    reroute_identity_conversions,
)
from fxpipe.codegen.render.classes import INDENT, ClassRegistry, ClassWriter, ModuleTree
from fxpipe.codegen.render.forward import render_forward
from fxpipe.codegen.render.functions import outline_helper_calls
from fxpipe.graphmeta import NAME_KEY
from fxpipe.codegen.render.leaf_constructors import leaf_constructor
from fxpipe.codegen.manifest import INPUT, BoundaryTensor
from fxpipe.codegen.render.naming import describe_modules
from fxpipe.codegen.render.operators import rewrite_aten
from fxpipe.codegen.graph.outline import outline_stage, stack_runs
from fxpipe.codegen.render.pyrender import MODEL_ALIAS, ImportTable, attr_expr, is_plain_name
from fxpipe.codegen.graph.scopes import Scope, scope_members
from fxpipe.codegen.shared import SHARED_SOURCE
from fxpipe.codegen.graph.split import SplitGraph, StageGraph
from fxpipe.codegen.graph.ownership import StageState
from fxpipe.codegen.render.statements import SOURCE_NAME_KEY, name_from_source
from fxpipe.shapeformula import BATCH
from fxpipe.errors import CodegenError

__all__ = ["StageSource", "SharedSource", "emit_stage", "emit_stages", "stage_class_name"]


def stage_class_name(index: int) -> str:
    return f"Stage{index}"


@dataclass(frozen=True)
class StageSource:
    """A rendered stage file, the name of its class, whether it imports the model file, and whether it imports the
    build's shared classes (``SharedSource``)."""

    class_name: str
    text: str
    imports_model_file: bool = False
    imports_shared: bool = False


@dataclass(frozen=True)
class SharedSource:
    """``shared.py``: the classes several stages of a build use (Note [classes several stages share])."""

    text: str
    imports_model_file: bool = False


@dataclass(frozen=True)
class _Rendered:
    """A stage rendered, not yet written as a file: which classes it keeps depends on the other stages."""

    index: int
    class_name: str
    num_stages: int
    model_label: str
    subgraph_classes: list[str]
    body: list[str]


# names a generated file defines or imports itself: no class or value may take them
_TAKEN = {
    "torch",
    "F",
    "os",
    "math",
    "operator",
    MODEL_ALIAS,
    "import_model_module",
    "_shared",
    "import_shared",
}


def emit_stage(
    stage: StageGraph,
    state: StageState,
    gm: fx.GraphModule,
    split: SplitGraph,
    *,
    num_stages: int,
    microbatch: int,
    model_label: str,
    user_leaf_args: Mapping[str, tuple[tuple, dict]],
    module_order: Mapping[str, int],
    model: nn.Module,
    build_dir: Path | None = None,
) -> StageSource:
    """Source text of ``stage_<index>.py`` for one stage graph and the tensors it owns, every class it uses in it.

    ``gm`` is the traced graph the stage was split from and ``model`` the original model
    (for module classes and ``torch.nn`` layer hyperparameters). ``emit_stages`` writes a build's
    stages together, with the classes several of them use written once.
    """
    registry = ClassRegistry(ImportTable(), _TAKEN | {stage_class_name(stage.index)})
    source = _Source(
        gm, split, num_stages, microbatch, model_label, user_leaf_args, module_order, model
    )
    return _assemble(_render(stage, state, registry, source), registry, set(), build_dir)


def emit_stages(
    split: SplitGraph,
    states: list[StageState],
    gm: fx.GraphModule,
    *,
    microbatch: int,
    model_label: str,
    user_leaf_args: Mapping[str, tuple[tuple, dict]],
    module_order: Mapping[str, int],
    model: nn.Module,
    build_dir: Path | None = None,
) -> tuple[list[StageSource], SharedSource | None]:
    """Every stage file of a build, and ``shared.py`` with the classes more than one of them uses (None when no
    class is used by two stages); see Note [classes several stages share] in :mod:`fxpipe.codegen.shared`."""
    num_stages = len(split.stages)
    registry = ClassRegistry(
        ImportTable(), _TAKEN | {stage_class_name(i) for i in range(num_stages)}
    )
    source = _Source(
        gm, split, num_stages, microbatch, model_label, user_leaf_args, module_order, model
    )
    rendered = [_render(sg, state, registry, source) for sg, state in zip(split.stages, states)]
    shared = {name for name, users in registry.users.items() if len(users) > 1}
    stages = [_assemble(r, registry, shared, build_dir) for r in rendered]
    if not shared:
        return stages, None
    code = "\n".join(registry.source(shared))
    names = _names_in(code)
    header = [
        f'"""Classes several stages of {model_label} use, generated by fxpipe.',
        "",
        "Do not edit: fxpipe.codegen.load_stage checks this file against the sha256 in manifest.json.",
        'Rebuild with `fxpipe partition` instead."""',
        "",
        *registry.imports.lines(build_dir, used=names),
        "",
        "",
    ]
    text = re.sub(r"\n{4,}", "\n\n\n", "\n".join(header) + "\n" + code).rstrip() + "\n"
    in_model = MODEL_ALIAS in names or bool(registry.imports.model_ops & names)
    return stages, SharedSource(
        text, imports_model_file=registry.imports.model_file is not None and in_model
    )


@dataclass(frozen=True)
class _Source:
    """What every stage of one build is rendered from (``emit_stage``'s and ``emit_stages``'
    arguments besides the stage): the traced graph, its split, the original model."""

    gm: fx.GraphModule
    split: SplitGraph
    num_stages: int
    microbatch: int
    model_label: str
    user_leaf_args: Mapping[str, tuple[tuple, dict]]
    module_order: Mapping[str, int]
    model: nn.Module


def _render(
    stage: StageGraph, state: StageState, registry: ClassRegistry, source: _Source
) -> _Rendered:
    gm, split, model, module_order = source.gm, source.split, source.model, source.module_order
    num_stages, microbatch, model_label = source.num_stages, source.microbatch, source.model_label
    user_leaf_args = source.user_leaf_args
    imports = registry.imports
    name = stage_class_name(stage.index)
    graph = _copy(stage.graph)
    rewrite_aten(graph)
    drop_metadata_asserts(graph)
    drop_unused_pure(graph)
    reroute_identity_conversions(graph)
    name_from_source(graph, key=SOURCE_NAME_KEY)  # what outlining names the bodies' arguments
    layers: dict[str, str | None] = {}
    outline = outline_stage(
        graph,
        model,
        owned=set(stage.nodes),
        original=_original_scopes(gm),
        leaves=set(stage.modules),
        is_subgraph=lambda t: isinstance(_get(gm, t), nn.Module),
        buildable=lambda path: _layer_constructor(path, model, imports, layers) is not None,
    )
    tree = ModuleTree(
        model, list(state.entries), state.aliases, module_order, classes=set(outline.bodies)
    )
    for path in stage.modules:
        tree.ctors[path] = leaf_constructor(
            path, gm.get_submodule(path), imports, user_leaf_args.get(path)
        )
    for path in sorted(outline.torch_layers):
        tree.ctors[path] = str(layers[path])
    subgraph_classes: list[str] = []
    for target in stage.attrs:
        sub = _get(gm, target)
        if isinstance(sub, nn.Module):
            cls = _subgraph_class(target, sub, imports, subgraph_classes)
            registry.taken.add(
                cls
            )  # defined in this stage's file: no shared class may take the name
            tree.ctors[target] = f"{cls}()"
    writer = ClassWriter(tree, registry, stage.index)
    for outlined in outline.bodies.values():
        writer.add(outlined)
    for container, paths in stack_runs(graph, writer.class_of, tree.held).items():
        writer.stack(container, paths)
    for function in outline_helper_calls(graph):  # Note [helper calls]
        registry.add_function(function, stage.index)
    name_from_source(graph)  # the module calls and helper calls outlining made
    tree.mark_indexed_containers()
    init = tree.init_lines("", stage=True)
    frozen = tree.frozen_lines()
    if frozen:
        init += [
            "# frozen in the model (requires_grad=False): no gradient, no optimizer state",
            *frozen,
        ]
    _name_outputs(graph, stage, split)
    forward = render_forward(
        graph,
        imports,
        lambda target: tree.expr("", target),
        workspace=writer.workspace,
        reserved=set(imports.names) | writer.taken,
    )
    doc = _class_doc(
        stage, split, num_stages, microbatch, describe_modules(gm, set(stage.nodes), module_order)
    )
    body = [
        f"class {name}(torch.nn.Module):",
        *_indent(doc),
        "",
        f"{INDENT}def __init__(self) -> None:",
        f"{INDENT * 2}super().__init__()",
        *_indent(init, 2),
    ]
    if state.aliases:
        body += [
            f"{INDENT * 2}self.tie_weights()",
            "",
            f"{INDENT}def tie_weights(self) -> None:",
            f'{INDENT * 2}"""Make every alias of a tied tensor the same object (called again after loading)."""',
        ]
        for alias, key in state.aliases.items():
            body.append(f"{INDENT * 2}{tree.expr('', alias)} = {tree.expr('', key)}")
    body += ["", *_indent(forward)]
    return _Rendered(stage.index, name, num_stages, model_label, subgraph_classes, body)


def _assemble(
    rendered: _Rendered, registry: ClassRegistry, shared: set[str], build_dir: Path | None
) -> StageSource:
    """The stage file: its imports, the shared classes it uses (imported), its own classes, its class."""
    local = registry.used_by(rendered.index) - shared
    code = "\n".join(
        [c + "\n\n" for c in rendered.subgraph_classes] + registry.source(local) + rendered.body
    )
    names = _names_in(code)
    imported = [n for n in registry.order() if n in shared and n in names]
    header = [
        f'"""Stage {rendered.index} of {rendered.num_stages} of {rendered.model_label}, generated by fxpipe.',
        "",
        "Do not edit: fxpipe.codegen.load_stage checks this file against the sha256 in manifest.json.",
        'Rebuild with `fxpipe partition` instead."""',
        "",
        *registry.imports.lines(build_dir, used=names),
    ]
    if imported:
        header += [
            "",
            "from fxpipe.codegen.shared import import_shared",
            "",
            f"_shared = import_shared(__file__)  # {SHARED_SOURCE} beside this file: classes several stages use",
            *(f"{n} = _shared.{n}" for n in imported),
        ]
    text = "\n".join(header + ["", "", code]).rstrip() + "\n"
    return StageSource(
        class_name=rendered.class_name,
        text=re.sub(r"\n{4,}", "\n\n\n", text),
        imports_model_file=registry.imports.model_file is not None
        and (MODEL_ALIAS in names or bool(registry.imports.model_ops & names)),
        imports_shared=bool(imported),
    )


def _names_in(code: str) -> set[str]:
    """The names the code uses (strings and comments left out): which imports a file needs."""
    return {
        t.string
        for t in tokenize.generate_tokens(io.StringIO(code).readline)
        if t.type == tokenize.NAME
    }


def _layer_constructor(
    path: str, model: nn.Module, imports: ImportTable, found: dict[str, str | None]
) -> str | None:
    """``torch.nn.Linear(32, 64)`` for the layer at ``path``, or None when it cannot be rebuilt from its
    hyperparameters (its traced body is emitted instead)."""
    if path not in found:
        try:
            found[path] = leaf_constructor(path, model.get_submodule(path), imports)
        except CodegenError:
            found[path] = None
    return found[path]


def _copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _original_scopes(gm: fx.GraphModule) -> dict[Scope, set[str]]:
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return {scope: {n.name for n in members} for scope, members in scope_members(nodes).items()}


def _name_outputs(graph: fx.Graph, stage: StageGraph, split: SplitGraph) -> None:
    """A value the stage returns is named as its boundary tensor (as the docstring and manifest name it)."""
    out = next(n for n in graph.nodes if n.op == "output")
    named: set[fx.Node] = set()
    for value, key in zip(out.args[0], stage.outputs):
        if (
            isinstance(value, fx.Node)
            and value.op not in ("placeholder", "get_attr")
            and value not in named
        ):
            value.meta[NAME_KEY] = split.boundary[key].name
            named.add(value)


def _indent(lines: list[str], levels: int = 1) -> list[str]:
    return [(INDENT * levels + line) if line else "" for line in lines]


def _dynamic(t: BoundaryTensor) -> bool:
    """Whether a dimension of ``t`` follows a dynamic size besides the batch (Note [shape formulas])."""
    return t.dims is not None and any(not f.isdigit() and f != BATCH for f in t.dims)


def _describe(t: BoundaryTensor) -> str:
    if _dynamic(t):
        assert t.dims is not None
        return f"{t.dtype}[{', '.join(t.dims)}]"
    batch = "no batch dim" if t.batch_dim is None else f"batch dim {t.batch_dim}"
    return f"{t.dtype}[{', '.join(map(str, t.shape))}], {batch}"


def _class_doc(
    stage: StageGraph,
    split: SplitGraph,
    num_stages: int,
    microbatch: int,
    modules: tuple[list[str], list[str]],
) -> list[str]:
    boundary = split.boundary
    whole, partial = modules
    lines = [f'"""Stage {stage.index} of {num_stages}: {len(stage.nodes)} graph nodes.', ""]
    if whole:
        lines += textwrap.wrap(
            ", ".join(whole),
            100,
            initial_indent="Modules: ",
            subsequent_indent=INDENT,
            break_on_hyphens=False,
        )
    if partial:
        lines += textwrap.wrap(
            ", ".join(partial),
            100,
            initial_indent="Part of: ",
            subsequent_indent=INDENT,
            break_on_hyphens=False,
        )
    if whole or partial:
        lines.append("")
    if any(_dynamic(boundary[k]) for k in (*stage.inputs, *stage.outputs)):
        lines.append(
            f"Inputs, in order (shapes as formulas of the microbatch {BATCH} and the dynamic sizes, "
            f"traced at {BATCH} = {microbatch}):"
        )
    else:
        lines.append(
            f"Inputs, in order (shapes at the traced microbatch {microbatch}; the batch dim may take any size):"
        )
    for key in stage.inputs:
        t = boundary[key]
        source = (
            f"model input {split.model_inputs.index(key)}"
            if t.producer == INPUT
            else f"from stage {t.producer}"
        )
        if t.dtype == "int64" and t.shape == () and key.endswith("_tensor") and t.producer != INPUT:
            source += " (a size, sent as a 0-d tensor)"
        lines.append(f"{INDENT}{t.name}: {_describe(t)}, {source}")
    if not stage.inputs:
        lines.append(f"{INDENT}(none)")
    lines.append("Outputs, in order:")
    for key in stage.outputs:
        t = boundary[key]
        where = (
            [f"to stage{'s' if len(t.consumers) > 1 else ''} {', '.join(map(str, t.consumers))}"]
            if t.consumers
            else []
        )
        if t.model_output is not None:
            where.append(f"model output {t.model_output}")
        lines.append(f"{INDENT}{t.name}: {_describe(t)}, {' and '.join(where)}")
    return lines + ['"""']


def _get(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _subgraph_class(path: str, sub: nn.Module, imports: ImportTable, classes: list[str]) -> str:
    """Emit a higher-order-op subgraph (e.g. a ``torch.no_grad()`` region) as its own class."""
    if not isinstance(sub, fx.GraphModule):
        raise CodegenError(
            f"get_attr {path!r} reads a {type(sub).__name__}; only tensors and fx subgraphs are supported"
        )
    name = "_" + "".join(p.capitalize() for p in re.split(r"[._]", path) if p)
    lines = [
        f"class {name}(torch.nn.Module):",
        f'{INDENT}"""The subgraph `{path}` of a higher-order op."""',
        "",
    ]
    children = []
    for node in sub.graph.nodes:
        if node.op == "get_attr":
            child = _get(sub, str(node.target))
            if not isinstance(child, fx.GraphModule):
                raise CodegenError(
                    f"subgraph {path!r} reads the tensor {node.target!r}; expected lifted inputs"
                )
            value = f"{_subgraph_class(f'{path}.{node.target}', child, imports, classes)}()"
            target = str(node.target)
            children.append(
                f"self.{target} = {value}"
                if is_plain_name(target)
                else f'self.add_module("{target}", {value})'
            )
    if children:
        lines += [
            f"{INDENT}def __init__(self) -> None:",
            f"{INDENT * 2}super().__init__()",
            *_indent(children, 2),
            "",
        ]
    graph = _copy(sub.graph)
    rewrite_aten(graph)
    drop_metadata_asserts(graph)
    lines += _indent(render_forward(graph, imports, lambda target: attr_expr("self", target)))
    classes.append("\n".join(lines))
    return name
