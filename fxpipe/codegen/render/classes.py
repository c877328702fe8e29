"""The module tree a stage builds, and the generated classes in it (one per distinct outlined body).

A ``ModuleTree`` says what lives at each module path of a stage: a constructor expression
(a generated class, a leaf layer, a container of blocks) or a plain container, and the
tensors created directly. Paths and ``state_dict`` keys are the original model's.

Note [one class per distinct body]: every outlined body is rendered relative to its own
path (``self.attn``, not ``self.h["3"].attn``). Two bodies whose class source is the same
text, with arguments named by position, are the same class: same operators, constants,
structure, submodule classes and tensor shapes, differing only in where they live. So
the text is emitted once and instantiated at each path; a body that differs in anything
gets a class of its own.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.codegen.render.forward import GeneratedFunction, render_function, run_blocks
from fxpipe.codegen.render.frees import Bytes
from fxpipe.codegen.render.functions import outline_helper_calls
from fxpipe.codegen.render.masks import short_form
from fxpipe.codegen.render.naming import module_ranges, unique_name
from fxpipe.codegen.graph.outline import Body, stack_runs
from fxpipe.codegen.render.pyrender import MODEL_MODULE_PREFIX, ImportTable, is_plain_name
from fxpipe.codegen.graph.ownership import BUFFER, PARAMETER, TensorEntry
from fxpipe.codegen.render.statements import name_from_source
from fxpipe.codegen.render.variants import SizedClass, declare, fill, sizes_of, slotted, template

__all__ = ["ModuleTree", "ClassRegistry", "ClassWriter", "INDENT"]

INDENT = "    "
_INDEXED = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _under(path: str, base: str) -> bool:
    return not base or path.startswith(base + ".")


@dataclass
class ModuleTree:
    """Constructor expressions and tensors of a stage, by original module path (see the module docstring)."""

    model: nn.Module
    tensors: list[TensorEntry]
    aliases: Mapping[str, str]
    order: Mapping[str, int]
    ctors: dict[str, str] = field(default_factory=dict)
    dict_paths: set[str] = field(
        default_factory=set
    )  # containers written as ModuleDict: children as h["3"]
    classes: set[str] = field(
        default_factory=set
    )  # paths built by a generated class (never a ModuleDict)

    def expr(self, base: str, path: str) -> str:
        """``self...`` for the module or tensor at ``path``, seen from the module at ``base``."""
        expr, current = "self", base
        for part in (path[len(base) + 1 :] if base else path).split(".") if path != base else ():
            if current in self.dict_paths:
                expr = f'{expr}["{part}"]'
            elif is_plain_name(part):
                expr = f"{expr}.{part}"
            else:
                expr = f'getattr({expr}, "{part}")'
            current = f"{current}.{part}" if current else part
        return expr

    def held(self, container: str) -> list[str]:
        """Paths directly under ``container`` that the stage builds something at."""
        prefix = f"{container}." if container else ""
        found = {
            prefix + path[len(prefix) :].split(".")[0]
            for path in list(self.ctors) + [_parent(e.key) for e in self.tensors]
            if path.startswith(prefix) and path != container
        }
        return sorted(found)

    def mark_indexed_containers(self) -> None:
        """Containers of numbered children (ModuleList, ModuleDict, Sequential) are built as ModuleDict."""
        for path in {_parent(p) for p in list(self.ctors) + [_parent(e.key) for e in self.tensors]}:
            while path:
                module = _get(self.model, path)
                if (
                    path not in self.ctors
                    and path not in self.classes
                    and isinstance(module, _INDEXED)
                    and all(c.rpartition(".")[2].isdigit() for c in self.held(path))
                ):
                    self.dict_paths.add(path)
                path = _parent(path)

    def _covered(self, path: str, base: str) -> bool:
        """Whether a constructor strictly between ``base`` and ``path`` (inclusive of path's ancestors) builds it."""
        p = _parent(path)
        while p and p != base and _under(p, base):
            if p in self.ctors:
                return True
            p = _parent(p)
        return False

    def init_lines(self, base: str, *, stage: bool) -> list[str]:
        """``__init__`` lines building everything under ``base`` that no constructor below it builds.

        At the stage level (``stage``), aliases of tied tensors are left to ``tie_weights()``.
        """
        mine = [
            e
            for e in self.tensors
            if _under(e.key, base) and not self._covered(e.key, base) and not e.leaf
        ]
        tensors = [e for e in mine if not (stage and e.key in self.aliases)]
        needed: set[str] = set()
        for path in [
            p for p in self.ctors if _under(p, base) and p != base and not self._covered(p, base)
        ] + [_parent(e.key) for e in mine]:  # an alias's owner too: tie_weights() sets it there
            while path and path != base:
                needed.add(path)
                path = _parent(path)
        lines: list[str] = []
        done: set[str] = set()
        for path in sorted(needed, key=lambda p: (self.order.get(p, math.inf), p)):
            if path in done or self._covered(path, base):
                continue
            if path in self.ctors:
                value = self.ctors[path]
            elif path in self.dict_paths:
                value, built = self._module_dict(path, needed, tensors)
                done.update(built)
            else:
                value = "torch.nn.Module()"
            lines.append(self._set_child(base, path, value))
        for e in tensors:
            owner, _, name = e.key.rpartition(".")
            target = self.expr(base, owner) if owner != base else "self"
            if e.kind == PARAMETER:
                grad = "" if e.tensor.requires_grad else ", requires_grad=False"
                value = f"torch.nn.Parameter({_empty(e.tensor)}{grad})"
                lines.append(
                    f"{target}.{name} = {value}"
                    if is_plain_name(name)
                    else f'{target}.register_parameter("{name}", {value})'
                )
            else:
                persistent = "" if e.kind == BUFFER else ", persistent=False"
                lines.append(f'{target}.register_buffer("{name}", {_empty(e.tensor)}{persistent})')
        return lines

    def frozen_lines(self) -> list[str]:
        """``requires_grad_(False)`` for the frozen parameters a constructor builds (Note [frozen parameters]).

        A parameter a generated class creates itself is written ``torch.nn.Parameter(...,
        requires_grad=False)`` in that class; one that a layer's constructor creates (a leaf, a
        rebuilt ``torch.nn`` layer) comes out of it trainable, so the stage freezes it after
        building, one line per outermost module whose parameters are all frozen.
        """
        params = [e for e in self.tensors if e.kind == PARAMETER and e.key not in self.aliases]
        trainable = [e.key for e in params if e.tensor.requires_grad]
        lines: list[str] = []
        done: set[str] = set()
        for e in params:
            if e.tensor.requires_grad or not self._built_by_constructor(e.key):
                continue
            target = e.key
            path = _parent(e.key)
            while path and not any(k.startswith(path + ".") for k in trainable):
                target, path = path, _parent(path)
            if target not in done:
                done.add(target)
                lines.append(f"{self.expr('', target)}.requires_grad_(False)")
        return lines

    def _built_by_constructor(self, key: str) -> bool:
        """Whether the nearest constructor above ``key`` is a layer's, not a generated class's own ``__init__``."""
        path = _parent(key)
        while path:
            if path in self.ctors:
                return path not in self.classes or self.ctors[path].startswith(
                    "torch.nn.Sequential("
                )
            path = _parent(path)
        return False

    def _module_dict(
        self, path: str, needed: set[str], tensors: list[TensorEntry]
    ) -> tuple[str, list[str]]:
        """The ModuleDict holding the leading children that a constructor builds (the rest are added after)."""
        children = sorted(
            (p for p in needed if _parent(p) == path), key=lambda p: int(p.rpartition(".")[2])
        )
        built: list[str] = []
        for child in children:
            if child not in self.ctors:
                break
            built.append(child)
        if not built or any(_parent(e.key) == path for e in tensors):
            return "torch.nn.ModuleDict()", []
        return (
            f"torch.nn.ModuleDict({numbered_dict({c.rpartition('.')[2]: self.ctors[c] for c in built})})",
            built,
        )

    def _set_child(self, base: str, path: str, value: str) -> str:
        parent, _, name = path.rpartition(".")
        target = self.expr(base, parent) if parent != base else "self"
        if parent in self.dict_paths:
            return f'{target}["{name}"] = {value}'
        if is_plain_name(name):
            return f"{target}.{name} = {value}"
        return f'{target}.add_module("{name}", {value})'


def numbered_dict(items: Mapping[str, str]) -> str:
    """``{"2": A(), "3": A()}`` as source; consecutive keys of one constructor as ``{str(i): A() for i in range(2, 4)}``."""
    keys = sorted(items, key=int)
    values = {items[k] for k in keys}
    consecutive = [int(k) for k in keys] == list(range(int(keys[0]), int(keys[-1]) + 1))
    if len(keys) > 1 and len(values) == 1 and consecutive:
        return f"{{str(i): {items[keys[0]]} for i in range({keys[0]}, {int(keys[-1]) + 1})}}"
    return "{" + ", ".join(f'"{k}": {items[k]}' for k in keys) + "}"


def _empty(t: torch.Tensor) -> str:
    shape = ", ".join(str(s) for s in t.shape) if t.dim() else "()"
    dtype = "" if t.dtype == torch.float32 else f", dtype={t.dtype}"
    return f"torch.empty({shape}{dtype})"


def _get(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


class ClassRegistry:
    """The generated classes of a build, one per distinct text, named once for all its stages (Note [one class
    per distinct body]; Note [classes several stages share] in :mod:`fxpipe.codegen.shared`).

    ``imports`` is the build's one import table (so a name means the same thing in every file),
    ``taken`` the names nothing else may take (the stage classes, ``torch``, ...); ``users`` says which
    stages use each class.
    """

    def __init__(self, imports: ImportTable, taken: set[str]) -> None:
        self.imports = imports
        self.taken = set(taken) | set(imports.names)
        self.by_text: dict[str, str] = {}
        self.sources: dict[
            str, tuple[str, list[str], list[str]]
        ] = {}  # name -> (doc subject, init, forward)
        self.instances: dict[str, list[str]] = {}
        self.stacks: dict[
            str, tuple[str, list[str]]
        ] = {}  # stack class -> (block class, argument names)
        self.params: dict[str, list[str]] = {}  # class -> forward's argument names
        self.peaks: dict[
            str, Bytes
        ] = {}  # class -> its forward's modelled peak (Note [frees that matter])
        self.users: dict[
            str, set[int]
        ] = {}  # class, stack class or function -> the stages that use it
        self.functions: dict[
            str, list[str]
        ] = {}  # generated function -> its lines (Note [helper calls])
        self.sized: dict[type, list[SizedClass]] = {}  # Note [classes that differ in their sizes]

    def fresh(self, wanted: str) -> str:
        name = unique_name(wanted, self.taken | set(self.imports.names))
        self.taken.add(name)
        self.imports.reserved.add(name)  # an import added later must not take this name
        return name

    def add_function(self, function: GeneratedFunction, stage: int) -> str:
        """Name ``function`` (Note [helper calls]): an identical earlier one's name, or a fresh one; ``stage`` uses it."""
        attr: Callable[[str], str] = lambda target: target  # noqa: E731 - a function reads no attribute
        positional = [
            f"arg{i}" for i, n in enumerate(function.graph.nodes) if n.op == "placeholder"
        ]
        short = short_form(function.graph)  # Note [short forms of mask helpers]
        key = "def\n" + (
            short.key
            if short is not None
            else "\n".join(
                render_function(
                    function.graph,
                    self.imports,
                    attr,
                    arg_names=positional,
                    workspace=self.function_peak,
                    name="f",
                    method=False,
                )[0]
            )
        )
        name = self.by_text.get(key)
        if name is None:
            name = self.fresh(function.wanted)
            self.by_text[key] = name
            function.name = name
            self.functions[name], self.peaks[name] = render_function(
                function.graph,
                self.imports,
                attr,
                workspace=self.function_peak,
                name=name,
                method=False,
            )  # a short form's peak: the traced operators' (they make more temporaries, not fewer)
            if short is not None:
                self.functions[name] = short.lines(name)
        function.name = name
        self.users.setdefault(name, set()).add(stage)
        return name

    def function_peak(self, node: fx.Node) -> Bytes | None:
        """The modelled peak of a call of a generated function (Note [frees that matter])."""
        if node.op == "call_function" and isinstance(node.target, GeneratedFunction):
            return self.peaks.get(node.target.name)
        return None

    def order(self) -> list[str]:
        """Every function, class and stack class, dependencies first (the order ``source`` writes them in)."""
        out: list[str] = list(self.functions)
        for name in self.sources:
            out.append(name)
            out += [stack for stack, (block, _) in self.stacks.items() if block == name]
        return out

    def sizes_of_class(self, name: str) -> tuple[str, ...]:
        """The sizes the class ``name`` takes (Note [classes that differ in their sizes]), if any."""
        return next((c.params for cs in self.sized.values() for c in cs if c.name == name), ())

    def used_by(self, stage: int) -> set[str]:
        return {name for name, stages in self.users.items() if stage in stages}

    def source(self, names: Iterable[str]) -> list[str]:
        """The functions and classes ``names``, dependencies first, each followed by two blank lines."""
        wanted = set(names)
        out: list[str] = []
        for name, lines in self.functions.items():
            if name in wanted:
                out += [*lines, "", ""]
        for name, (subject, init, forward) in self.sources.items():
            if name in wanted:
                where = ", ".join(module_ranges(self.instances[name]))
                out += [
                    f"class {name}(torch.nn.Module):",
                    f'{INDENT}"""{subject} as traced, at {where}."""',
                    "",
                ]
                sizes = self.sizes_of_class(name)
                if init or sizes:
                    signature, keep = declare(sizes)
                    out += [
                        f"{INDENT}def __init__(self{', ' if sizes else ''}{signature}) -> None:",
                        f"{INDENT * 2}super().__init__()",
                        *(INDENT * 2 + ln for ln in keep + init),
                        "",
                    ]
                out += [INDENT + ln for ln in forward] + ["", ""]
            for stack, (block, params) in self.stacks.items():
                if block == name and stack in wanted:
                    out += _stack_source(stack, block, params)
        return out


class ClassWriter:
    """Renders one stage's outlined bodies as classes of the build's ``ClassRegistry``."""

    def __init__(self, tree: ModuleTree, registry: ClassRegistry, stage: int = 0) -> None:
        self.tree = tree
        self.registry = registry
        self.imports = registry.imports
        self.stage = stage
        self.class_of: dict[str, str] = {}
        self.peak_of: dict[str, Bytes] = {}  # a body of a class that takes sizes -> its own peak
        self.blocks: dict[str, str] = {}  # a container running blocks in order -> the blocks' class

    @property
    def taken(self) -> set[str]:
        return self.registry.taken

    def _use(self, name: str) -> None:
        self.registry.users.setdefault(name, set()).add(self.stage)

    def add(self, body: Body) -> str:
        """The class for ``body`` (new or an identical earlier one); registers its constructor in the tree."""
        sequential = self._sequential(body)
        if sequential is not None:
            self.tree.ctors[body.path] = sequential
            return "torch.nn.Sequential"
        for container, paths in stack_runs(
            body.graph, self.class_of, self.tree.held, within=body.path
        ).items():
            self.stack(container, paths)
        for function in outline_helper_calls(body.graph):
            self.registry.add_function(function, self.stage)
        name_from_source(body.graph, body.depth)
        self.tree.mark_indexed_containers()
        init = self.tree.init_lines(body.path, stage=False)
        attr: Callable[[str], str] = lambda target: self.tree.expr(body.path, target)  # noqa: E731
        positional = [f"arg{i}" for i, n in enumerate(body.graph.nodes) if n.op == "placeholder"]
        by_position, peak = render_function(
            body.graph, self.imports, attr, arg_names=positional, workspace=self.workspace
        )
        key = "\n".join(init + by_position)
        own = [e.tensor for e in self.tree.tensors if _parent(e.key) == body.path]
        sizes = sizes_of(self.tree.model, body.path, own) if own else {}
        if sizes:
            sized = self._sized(body, init, by_position, key, sizes, peak)
            if sized is not None:
                return sized
        registry = self.registry
        name = registry.by_text.get(key)
        if name is None:
            name = registry.fresh(body.module_type.__name__)
            registry.by_text[key] = name
            subject = _describe_class(body.module_type)
            forward, registry.peaks[name] = render_function(
                body.graph, self.imports, attr, workspace=self.workspace
            )
            registry.sources[name] = (subject, init, forward)
            registry.params[name] = (
                forward[0].removeprefix("def forward(self").removesuffix("):").split(", ")[1:]
            )
            registry.instances[name] = []
        registry.instances[name].append(body.path)
        self._use(name)
        self.class_of[body.path] = name
        self.tree.ctors[body.path] = f"{name}()"
        return name

    def _sized(
        self,
        body: Body,
        init: list[str],
        by_position: list[str],
        key: str,
        sizes: dict[str, int],
        peak: Bytes,
    ) -> str | None:
        """The class taking sizes that ``body`` is an instance of (Note [classes that differ in their sizes]): an
        earlier one whose text with ``sizes`` written in is ``key``, or a new one; None when no number of the
        body is one of its sizes."""
        registry = self.registry
        known = registry.sized.setdefault(body.module_type, [])
        found = next(
            (
                c
                for c in known
                if all(p in sizes for p in c.params)
                and "\n".join(fill(c.key.split("\n"), sizes)) == key
            ),
            None,
        )
        if found is None:
            slotted_init = template(init, sizes, init=True)
            slotted_key = slotted_init + template(by_position, sizes, init=False)
            used = slotted(slotted_key)
            params = tuple(p for p in sizes if p in used)
            if not params:
                return None
            assert "\n".join(fill(slotted_key, sizes)) == key
            attr: Callable[[str], str] = lambda target: self.tree.expr(body.path, target)  # noqa: E731
            forward = render_function(body.graph, self.imports, attr, workspace=self.workspace)[0]
            found = SizedClass(
                registry.fresh(body.module_type.__name__), params, "\n".join(slotted_key)
            )
            known.append(found)
            registry.sources[found.name] = (
                _describe_class(body.module_type),
                fill(slotted_init, {p: p for p in params}),
                fill(template(forward, sizes, init=False), {p: f"self.{p}" for p in params}),
            )
            registry.params[found.name] = (
                forward[0].removeprefix("def forward(self").removesuffix("):").split(", ")[1:]
            )
            registry.peaks[found.name] = peak
            registry.instances[found.name] = []
        name = found.name
        registry.instances[name].append(body.path)
        self._use(name)
        self.class_of[body.path] = name
        self.peak_of[body.path] = peak
        self.tree.ctors[body.path] = f"{name}({', '.join(f'{p}={sizes[p]}' for p in found.params)})"
        return name

    def workspace(self, node: fx.Node) -> Bytes | None:
        """The modelled peak of a call of a generated class (or of a container of them, or of a generated
        function), else None."""
        if node.op == "call_function" and isinstance(node.target, GeneratedFunction):
            return self.registry.function_peak(node)
        if node.op == "call_module":
            target = str(node.target)
            if target in self.peak_of:
                return self.peak_of[target]
            name = self.class_of.get(target) or self.blocks.get(target)
        elif node.op == "call_function" and node.target is run_blocks:
            name = self.class_of.get(f"{node.args[0]}.{node.args[1]}")
        else:
            return None
        return self.registry.peaks.get(name) if name is not None else None

    def _sequential(self, body: Body) -> str | None:
        """``torch.nn.Sequential(...)`` when the body is an ``nn.Sequential`` running all its children in order."""
        module = _get(self.tree.model, body.path)
        if type(module) is not nn.Sequential or module._forward_hooks or module._forward_pre_hooks:
            return None
        nodes = [n for n in body.graph.nodes if n.op not in ("get_attr",)]
        children = [f"{body.path}.{i}" for i in range(len(module))]
        if len(nodes) != len(children) + 2 or [n.op for n in nodes[1:-1]] != ["call_module"] * len(
            children
        ):
            return None
        previous = nodes[0]
        for node, child in zip(nodes[1:-1], children):
            if (
                str(node.target) != child
                or tuple(node.args) != (previous,)
                or node.kwargs
                or child not in self.tree.ctors
            ):
                return None
            previous = node
        if nodes[-1].args[0] is not previous:
            return None
        return f"torch.nn.Sequential({', '.join(self.tree.ctors[c] for c in children)})"

    def stack(self, container: str, paths: list[str]) -> None:
        """Register a container that runs the blocks ``paths`` in order (see ``outline.stack_runs``)."""
        block = self.class_of[paths[0]]
        registry = self.registry
        stack = next((s for s, (b, _) in registry.stacks.items() if b == block), None)
        if stack is None:
            stack = registry.fresh(f"{block}Stack")
            registry.stacks[stack] = (block, registry.params[block])
        self._use(stack)
        self.blocks[container] = block
        children = {p.rpartition(".")[2]: self.tree.ctors[p] for p in paths}
        self.tree.ctors[container] = f"{stack}({numbered_dict(children)})"
        self.tree.dict_paths.add(container)

    def source(self) -> list[str]:
        """Every class this stage uses, dependencies first, each followed by two blank lines."""
        return self.registry.source(self.registry.used_by(self.stage))


def _describe_class(cls: type) -> str:
    """``GPT2Block (transformers.models.gpt2.modeling_gpt2)``, or ``Block (gpt.py)`` for a model file's class."""
    module = sys.modules.get(cls.__module__)
    where = cls.__module__
    path = getattr(module, "__file__", None)
    if cls.__module__.startswith(MODEL_MODULE_PREFIX) and path:
        where = Path(str(path)).name
    return f"{cls.__qualname__} ({where})"


def _stack_source(stack: str, block: str, names: list[str]) -> list[str]:
    args = ", ".join(names)
    rest = "".join(f", {n}" for n in names[1:])
    return [
        f"class {stack}(torch.nn.ModuleDict):",
        f'{INDENT}"""{block} modules run in order, each on the output of the one before."""',
        "",
        f"{INDENT}def forward(self, {args}):",
        f"{INDENT * 2}for block in self.values():",
        f"{INDENT * 3}{names[0]} = block({names[0]}{rest})",
        f"{INDENT * 2}return {names[0]}",
        "",
        "",
    ]
