"""The package's import contract (Note [layers]): layers only point down, no module imports itself
back through others, and a worker loads the runtime, not the compiler.

Note [layers]: fxpipe's packages form one order, lowest first::

    errors, schema, jsonio, graphmeta, model_inputs, modelfile, calibration_data, optionspec, unexpected, userfiles,
    sizes, _lazy (the base)
    < tracer < partitioner < codegen < runtime < {smp, sharding} < cli

A module may import its own layer and any below it, never one above; ``smp`` and ``sharding`` are
siblings that do not import each other. ``fxpipe/__init__.py``, ``__main__.py`` and ``amp.py`` are
the public facade over all of them. Every import statement counts -- at the top of a module, inside
a function, or under ``TYPE_CHECKING`` -- since an import moved into a function still ties the two
modules together. Read statically (the AST), so the test needs no torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "fxpipe"

BASE = {
    "errors",
    "schema",
    "jsonio",
    "graphmeta",
    "model_inputs",
    "modelfile",
    "unexpected",
    "calibration_data",
    "optionspec",
    "userfiles",
    "sizes",
    "shapeformula",
    "_lazy",
}
RANK = {
    **dict.fromkeys(BASE, 0),
    "tracer": 1,
    "partitioner": 2,
    "codegen": 3,
    "runtime": 4,
    "smp": 5,
    "sharding": 5,
    "cli": 6,
}
FACADE = {"fxpipe", "fxpipe.__main__", "fxpipe.amp"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every fxpipe module ``module`` imports, wherever the statement stands."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("fxpipe") and name != module:
                found.add(name)
    return found


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        graph.add_edges_from((module, target) for target in _imports(module, path, modules))
    return graph


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_layers_point_down() -> None:
    graph = _graph()
    wrong = []
    for src, dst in graph.edges:
        if src in FACADE or dst == "fxpipe":
            continue
        a, b = _layer(src), _layer(dst)
        assert a in RANK and b in RANK, f"{src} or {dst} is in no layer: add it to Note [layers]"
        if RANK[b] > RANK[a] or (RANK[a] == RANK[b] == 5 and a != b):
            wrong.append(f"{src} imports {dst}")
    assert not wrong, "imports against the layer order (Note [layers]):\n" + "\n".join(
        sorted(wrong)
    )


def test_no_import_cycles() -> None:
    graph = _graph()
    graph.remove_nodes_from(FACADE)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "modules that import each other, directly or through others:\n" + "\n".join(
        map(str, cycles)
    )


def test_worker_loads_the_runtime_not_the_compiler() -> None:
    """A training rank imports the runtime and what stages need: no solver, no tracer front end, no
    report, no seed API -- and not OR-Tools."""
    code = (
        "import sys, fxpipe.runtime.launch.worker, fxpipe.runtime.train.loop; "
        "print('\\n'.join(m for m in sys.modules if m.startswith(('fxpipe', 'ortools'))))"
    )
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True
        ).stdout.split()
    )
    compiler = {
        m
        for m in loaded
        if m.startswith(
            (
                "fxpipe.partitioner.solve",
                "fxpipe.partitioner.search.configurations",
                "fxpipe.partitioner.report.terminal",
                "fxpipe.smp",
                "fxpipe.sharding",
                "fxpipe.cli",
                "ortools",
                "fxpipe.codegen.build",
                "fxpipe.codegen.render.emit",
                "fxpipe.codegen.graph.split",
                "fxpipe.tracer.api",
                "fxpipe.tracer.frontend.symbolic",
                "fxpipe.tracer.frontend.export_frontend",
            )
        )
    }
    assert not compiler, f"a worker imports the compiler: {sorted(compiler)}"
