"""A cache of traced models: the same model file traced the same way is traced once.

Note [the trace cache]: ``fxpipe partition MODEL --stages 4`` after ``--stages 2`` traces the
same model at the same microbatch size; only the plan differs. What the trace produced (the
normalized graph with its ``meta``, the units, the profile, the output structure) is stored
under a key of everything that decides it, and a later trace with the same key reads it back
instead of tracing and counting again (its progress line says ``trace: cached``).

The key (:func:`trace_key`) hashes the model file's bytes, its path and function names, the
Python files it imports from its own folder (``_zoo.py`` beside a zoo model), the example
inputs at the traced batch size (their shapes, dtypes and values, and every other argument),
the trace options, the versions of Python, torch and transformers, and fxpipe's own source
(any change to fxpipe misses). Measured times and memory also key on the host. A model file
edited since, a new option or a new torch: a miss, and the trace runs afresh.

What is stored is the :class:`~fxpipe.tracer.traced.TracedModel` less its model: the model is
built again from the model file (the build needs its weights anyway), and every module,
parameter and buffer of it that the graph refers to is stored by name and bound to the new
model's on reading (pickle's persistent ids). Graphs are stored node by node with their
``meta``; torch's own pickling of a ``GraphModule`` regenerates it from source and drops the
``meta`` codegen reads. Export's fake tensors and symbolic sizes are stored as their sizes'
expressions and built again in a fresh shape environment, so a size prints as it did
(``s77``), which is what codegen compares.

The cache fails open: anything that cannot be stored (an object pickle refuses in a graph's
``meta``) or read back (a torch that changed its internals, a file cut short) means the model is
traced as if there were no cache, and a failed read removes the entry. Meta-device traces are not
cached (their buffers are recomputed into the model while tracing). Entries are written whole
(a temporary file renamed, readable by its owner only), so concurrent partitions never read half
a file. An entry is a pickle, read as torch.compile reads its own cache: the folder must be the
user's own (``~/.cache/fxpipe`` is), never one that others can write to. The folder is kept
within a size budget, least recently used entries removed first (Note [the trace cache's budget]
in ``fxpipe.tracer.trace_cache_prune``).

A hit tells the user what the first trace told them: fxpipe's own warnings shown while tracing
(``fxpipe: symbolic tracing failed inside 'blocks.0.attn' ...; keeping it whole``, a batch traced
static, data checks kept as runtime asserts) are stored in the entry as they were shown (text,
category, file and line) and shown again, once each, through the same ``warnings`` machinery on
every hit, so filters and ``-W error`` treat them alike. Other libraries' warnings are not
stored: the model's build, which a hit runs again, and the check, which runs the model, raise
them again themselves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import pickle
import platform
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.modelfile import ModelSource
from fxpipe.tracer.seeding import seeded
from fxpipe.tracer.trace_cache_prune import TEMP_PREFIX, prune
from fxpipe.tracer.trace_options import DEFAULT_TRACE_CACHE_GIB
from fxpipe.tracer.traced import TracedModel

__all__ = ["TraceCache", "trace_cached", "trace_key"]

_FORMAT = 2  # bump when what is stored changes (2: the warnings shown while tracing)
_FXPIPE_ROOT = Path(__file__).resolve().parents[1]


# -- the key ---------------------------------------------------------------------------------


@functools.cache
def _fxpipe_source_hash() -> str:
    """One hash of fxpipe's Python source and data files: any change to fxpipe is a new key."""
    h = hashlib.sha256()
    for path in sorted(_FXPIPE_ROOT.rglob("*")):
        if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_FXPIPE_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _local_imports(source: ModelSource) -> dict[str, str]:
    """The sha256 of every Python file imported from the model file's folder (or below it),
    the model file excluded: helpers beside a model file decide what it builds."""
    folder = source.path.resolve().parent
    hashes: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        path = Path(file).resolve()
        if path == source.path.resolve() or folder not in path.parents:
            continue
        if {"site-packages", "dist-packages"} & set(path.parts):  # a package: its version counts
            continue
        with contextlib.suppress(OSError):
            hashes[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(hashes.items()))


@functools.cache
def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "timm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def _hash_value(h: Any, value: Any) -> None:
    """Feed an example argument into ``h``: tensors by dtype, shape and bytes, containers by
    their structure, anything else by its ``repr``."""
    leaves, spec = pytree.tree_flatten(value)
    h.update(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}{t.requires_grad}".encode())
            if t.device.type != "meta":
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(leaf).encode())


def trace_key(source: ModelSource, batch_size: int, inputs: Any, options: dict[str, Any]) -> str:
    """The cache key of tracing ``source`` at ``batch_size`` with ``options`` (``trace_model_file``'s
    keyword arguments) on ``inputs`` (its ``example_call``): Note [the trace cache]."""
    h = hashlib.sha256()
    described = {
        "format": _FORMAT,
        "file": str(source.path.resolve()),
        "sha256": source.sha256,
        "model_fn": source.model_fn,
        "inputs_fn": source.inputs_fn,
        "imports": _local_imports(source),
        "batch_size": batch_size,
        "options": {k: repr(v) for k, v in sorted(options.items())},
        "versions": _versions(),
        "fxpipe": _fxpipe_source_hash(),
    }
    if options.get("measure_times") or options.get("measure_memory"):
        described["host"] = platform.node()  # measured figures are the host's
    h.update(json.dumps(described, sort_keys=True).encode())
    _hash_value(h, (inputs.args, inputs.kwargs))
    return h.hexdigest()


# -- storing ---------------------------------------------------------------------------------


class _NotCacheable(Exception):
    """Something in the trace that the cache cannot store; the trace stays uncached."""


@dataclass(frozen=True)
class _Ref:
    """A node of the graph being rebuilt, by name."""

    name: str


@dataclass
class _Loading:
    """What reading needs at hand: the fake mode whose shape environment rebuilds sizes."""

    shape_env: Any
    fake_mode: Any
    storages: dict[int, torch.Tensor] = field(default_factory=dict)  # by number: flat bytes


_LOADING: list[_Loading] = []


def _op(namespace: str, name: str, overload: str | None) -> Any:
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


def _symbols(node: Any) -> tuple[tuple[Any, Any, Any], ...]:
    """Each free symbol of a symbolic size with its value at the trace and its range."""
    env = node.shape_env
    out = []
    for sym in sorted(node.expr.free_symbols, key=str):
        vr = env.var_to_range.get(sym)
        out.append(
            (sym, env.backed_var_to_val.get(sym), None if vr is None else (vr.lower, vr.upper))
        )
    return tuple(out)


def _declare(symbols: tuple[tuple[Any, Any, Any], ...]) -> Any:
    """The loading shape environment, knowing ``symbols`` (as :func:`_symbols` gave them)."""
    from torch.utils._sympy.value_ranges import ValueRanges

    env = _LOADING[-1].shape_env
    for sym, val, bounds in symbols:
        if sym in env.var_to_range:
            continue
        if val is not None:
            env.backed_var_to_val[sym] = val
        if bounds is not None:
            env.var_to_range[sym] = ValueRanges(*bounds)
    return env


def _symint(expr: Any, hint: Any, symbols: tuple[tuple[Any, Any, Any], ...]) -> Any:
    return _declare(symbols).create_symintnode(expr, hint=hint)


def _symfloat(expr: Any, hint: Any, symbols: tuple[tuple[Any, Any, Any], ...]) -> Any:
    return _declare(symbols).create_symfloatnode(expr, hint=hint)


def _symbool(expr: Any, symbols: tuple[tuple[Any, Any, Any], ...]) -> Any:
    return _declare(symbols).create_symboolnode(expr)


def _fake(
    storage: int,
    nbytes: Any,
    dtype: torch.dtype,
    device: torch.device,
    size: tuple[Any, ...],
    stride: tuple[Any, ...],
    offset: Any,
    requires_grad: bool,
) -> torch.Tensor:
    """A fake tensor as traced, on the storage numbered ``storage``: values that shared a storage
    (a view and its base, ``x.to(x.dtype)`` and ``x``) share one again, which codegen's aliasing
    reads (``fxpipe.codegen.graph.aliases``)."""
    loading = _LOADING[-1]
    with loading.fake_mode:
        if storage < 0 and not offset:  # a storage of its own (most values): one fake call
            t = torch.empty_strided(size, stride, dtype=dtype, device=device)
            return t.requires_grad_(requires_grad) if requires_grad else t
        flat = loading.storages.get(storage)
        if flat is None:
            flat = loading.storages[storage] = torch.empty(
                (nbytes,), dtype=torch.uint8, device=device
            )
        t = flat.view(dtype).as_strided(size, stride, offset)
    return t.requires_grad_(requires_grad) if dtype.is_floating_point or dtype.is_complex else t


def _rebuild_graph(codegen: Any, nodes: list[tuple[Any, ...]]) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    graph._codegen = codegen
    made: dict[str, torch.fx.Node] = {}

    def resolve(a: Any) -> Any:
        if isinstance(a, _Ref):
            return made[a.name]
        if isinstance(a, tuple):
            return (
                type(a)(*(resolve(x) for x in a))
                if hasattr(a, "_fields")
                else tuple(resolve(x) for x in a)
            )
        if isinstance(a, list):
            return [resolve(x) for x in a]
        if isinstance(a, dict):
            return {k: resolve(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(resolve(a.start), resolve(a.stop), resolve(a.step))
        return a

    for op, name, target, args, kwargs, type_expr, meta in nodes:
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name, type_expr)
        if node.name != name:
            raise _NotCacheable(f"node {name} came back as {node.name}")
        node.meta = meta
        made[name] = node
    return graph


def _rebuild_module(state: dict[str, Any], graph: torch.fx.Graph) -> torch.fx.GraphModule:
    gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    gm.__dict__.update(state)
    gm.graph = graph  # recompiles its forward from the graph
    return gm


class _Pickler(pickle.Pickler):
    """Stores a traced model: the model's own objects by name, graphs node by node, fake tensors
    and symbolic sizes by their expressions (Note [the trace cache])."""

    def __init__(
        self, file: io.BytesIO, owned: dict[int, tuple[str, str]], shared: set[int]
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.owned = owned
        self.shared = shared  # the fake storages two values or more hold
        self.storages: dict[int, int] = {}  # a fake storage's id -> its number in the file

    def persistent_id(self, obj: Any) -> Any:
        return self.owned.get(id(obj)) if isinstance(obj, (nn.Module, torch.Tensor)) else None

    def reducer_override(self, obj: Any) -> Any:  # one case per kind of object
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        if isinstance(obj, torch._ops.OpOverload):
            return _op, (obj.namespace, obj._schema.name.split("::")[-1], obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return _op, (obj._qualified_op_name.split("::")[0], obj.__name__, None)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            name = str(obj.__name__)
            if getattr(torch.ops.higher_order, name, None) is not obj:
                raise _NotCacheable(f"operator {name}")
            return _higher_order, (name,)
        if isinstance(obj, torch.SymInt):
            return _symint, (obj.node.expr, obj.node.hint, _symbols(obj.node))
        if isinstance(obj, torch.SymFloat):
            return _symfloat, (obj.node.expr, obj.node.hint, _symbols(obj.node))
        if isinstance(obj, torch.SymBool):
            return _symbool, (obj.node.expr, _symbols(obj.node))
        if isinstance(obj, ShapeEnv) or type(obj).__name__ == "FakeTensorMode":
            raise _NotCacheable(type(obj).__name__)
        if isinstance(obj, FakeTensor):
            storage = obj.untyped_storage()
            return _fake, (
                self.storages.setdefault(storage._cdata, len(self.storages))
                if storage._cdata in self.shared
                else -1,
                storage.nbytes(),
                obj.dtype,
                obj.fake_device,
                tuple(obj.shape),
                tuple(obj.stride()),
                obj.storage_offset(),
                obj.requires_grad,
            )
        if isinstance(obj, torch.fx.Graph):
            return _rebuild_graph, (obj._codegen, [_node_record(n) for n in obj.nodes])
        if isinstance(obj, torch.fx.GraphModule):
            state = {
                k: v
                for k, v in obj.__dict__.items()
                if k not in ("_graph", "_code", "shape_env") and not k.startswith("_lazy")
            }
            return _rebuild_module, (state, obj.graph)
        if isinstance(obj, torch.fx.Node):
            raise _NotCacheable(f"a graph node ({obj.name}) outside its graph's arguments")
        return NotImplemented


def _node_record(node: torch.fx.Node) -> tuple[Any, ...]:
    def ref(n: torch.fx.Node) -> Any:
        return _Ref(n.name)

    return (
        node.op,
        node.name,
        node.target,
        torch.fx.node.map_arg(node.args, ref),
        torch.fx.node.map_arg(node.kwargs, ref),
        node.type,
        dict(node.meta),
    )


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, model: nn.Module) -> None:
        super().__init__(file)
        self.model = model

    def persistent_load(self, pid: Any) -> Any:
        kind, name = pid
        if kind == "module":
            return self.model.get_submodule(name)
        if kind == "parameter":
            return self.model.get_parameter(name)
        return self.model.get_buffer(name)


def _owned(model: nn.Module) -> dict[int, tuple[str, str]]:
    """Every module, parameter and buffer of ``model`` by id, under its first name."""
    owned: dict[int, tuple[str, str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        owned.setdefault(id(m), ("module", name))
    for name, p in model.named_parameters(remove_duplicate=False):
        owned.setdefault(id(p), ("parameter", name))
    for name, b in model.named_buffers(remove_duplicate=False):
        owned.setdefault(id(b), ("buffer", name))
    return owned


def _shared_storages(gm: torch.fx.GraphModule) -> set[int]:
    """The fake storages that more than one traced value holds, in ``gm`` and its subgraphs."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen: dict[int, set[int]] = {}
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                for leaf in pytree.tree_leaves(node.meta.get("val")):
                    if isinstance(leaf, FakeTensor):
                        seen.setdefault(leaf.untyped_storage()._cdata, set()).add(id(leaf))
    return {storage for storage, values in seen.items() if len(values) > 1}


def _dumps(traced: TracedModel, shown: list[ShownWarning]) -> bytes:
    buf = io.BytesIO()
    fields = {k: v for k, v in traced.__dict__.items() if k != "model"}
    shared = _shared_storages(traced.graph_module)
    _Pickler(buf, _owned(traced.model), shared).dump((fields, [tuple(w) for w in shown]))
    return buf.getvalue()


def _loads(data: bytes, model: nn.Module) -> tuple[TracedModel, list[ShownWarning]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    _LOADING.append(_Loading(shape_env, FakeTensorMode(shape_env=shape_env)))
    try:
        with warnings.catch_warnings():  # pytree's leaf specs unpickle through a deprecated class
            warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)
            fields, shown = _Unpickler(io.BytesIO(data), model).load()
    finally:
        _LOADING.pop()
    fields["graph_module"].shape_env = shape_env
    return TracedModel(model=model, **fields), [ShownWarning(*w) for w in shown]


# -- the warnings of a trace -------------------------------------------------------------------


class ShownWarning(NamedTuple):
    """A warning as ``warnings`` showed it: what a hit shows again (Note [the trace cache])."""

    message: str
    category: type[Warning]
    filename: str
    lineno: int


@contextlib.contextmanager
def _shown_warnings() -> Iterator[list[ShownWarning]]:
    """Show the warnings of the block as always, and list fxpipe's own among them: those the
    filters let through (a warning ignored is not listed; one that ``-W error`` raises ends the
    trace anyway). Only ``warnings.showwarning`` is wrapped, so filters the block adds (an import
    of transformers) stay, as they do without a cache."""
    shown: list[ShownWarning] = []
    previous = warnings.showwarning

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if str(message).startswith("fxpipe:") and isinstance(category, type):
            shown.append(ShownWarning(str(message), category, filename, lineno))
        previous(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield shown
    finally:
        if warnings.showwarning is showwarning:  # else the block installed its own: leave it
            warnings.showwarning = previous


def _show_again(shown: list[ShownWarning]) -> None:
    """Show ``shown`` as the trace that stored them showed them, through the user's filters."""
    for w in shown:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@dataclass(frozen=True)
class TraceCache:
    """Traces stored in ``folder`` (``trace_options.default_cache_dir() / "traces"`` by default), one file a key."""

    folder: Path

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.pt"

    def load(self, key: str, model: nn.Module) -> tuple[TracedModel, list[ShownWarning]] | None:
        """The trace stored under ``key`` bound to ``model`` (built afresh) and the warnings its
        trace showed, or None: not stored (or removed meanwhile), or unreadable (the entry is then
        removed). A hit marks the entry as just used (Note [the trace cache's budget])."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            loaded = _loads(data, model)
        except Exception:  # noqa: BLE001 - a stale or broken entry is a miss, never an error
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):  # pruned meanwhile: what was read is whole
            os.utime(path)
        return loaded

    def store(
        self, key: str, traced: TracedModel, shown: list[ShownWarning] | None = None
    ) -> str | None:
        """Store ``traced`` under ``key``, with the warnings its trace ``shown``; None when
        stored, else why not (the trace is kept uncached: Note [the trace cache])."""
        try:
            data = _dumps(traced, shown or [])
        except Exception as exc:  # noqa: BLE001 - whatever pickle refuses leaves the trace uncached
            return f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=TEMP_PREFIX, suffix=".pt")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(key))
        except OSError as exc:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(tmp)
            return f"cannot write {self.folder}: {exc.strerror or exc}"
        return None


def trace_cached(
    source: ModelSource,
    batch_size: int,
    cache_dir: str | Path | None,
    *,
    budget: int = int(DEFAULT_TRACE_CACHE_GIB * 2**30),
    **options: Any,
) -> TracedModel:
    """``trace_model_file(source, batch_size, **options)``, read from the cache in ``cache_dir``
    when the same trace is stored there, and stored after tracing when it is not (Note [the
    trace cache]), the cache then pruned to ``budget`` bytes (Note [the trace cache's budget]);
    ``cache_dir=None`` traces without the cache."""
    from fxpipe.tracer.api import trace_model_file
    from fxpipe.tracer.measure.meta import META
    from fxpipe.tracer.progress import note, phase
    from fxpipe.tracer.construct.record import build_model_recorded

    if cache_dir is None or options.get("trace_device") == META:
        return trace_model_file(source, batch_size, **options)
    with seeded(None):  # the key's inputs draw nothing the model's build would see
        key = trace_key(source, batch_size, source.example_call(batch_size), options)
    cache = TraceCache(Path(cache_dir) / "traces")
    if cache.path(key).is_file():
        with phase("build the model"):
            model, _ = build_model_recorded(source.build_model)
        with phase("trace: cached") as reading:
            loaded = cache.load(key, model)
            if loaded is not None:
                traced, shown = loaded
                reading.detail = f"{traced.frontend}, {len(traced.profile.units)} units"
                _show_again(shown)
        if loaded is not None:
            return traced
        note("trace: the cached trace could not be read; tracing again")
    with _shown_warnings() as shown:
        traced = trace_model_file(source, batch_size, **options)
    why = cache.store(key, traced, shown)
    if why is not None:
        note(f"trace: not cached ({why})")
        return traced
    removed = prune(cache.folder, budget, keep=cache.path(key).name).line(budget)
    if removed is not None:
        note(removed)
    return traced
