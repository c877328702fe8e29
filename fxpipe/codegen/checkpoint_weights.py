"""Stage weights of a meta build: read from a checkpoint one tensor at a time, or left for load-time init.

Note [stage weights from a checkpoint]: a model traced on the meta device (Note [meta
tracing] in :mod:`fxpipe.tracer.measure.meta`) has no values. ``--weights PATH`` names a
checkpoint: a ``.safetensors`` file, a directory of safetensors shards with an index JSON
(``model.safetensors.index.json``, as transformers saves them) or of plain ``.safetensors``
files, or a ``torch.save``d state dict (read with ``weights_only=True`` and ``mmap=True``).
Before any stage is written, its keys are checked against the model's ``state_dict``:
missing, unexpected and mis-shaped keys are one :class:`~fxpipe.errors.WeightsError` line.
A tied parameter is read under any of its keys (transformers saves ``lm_head.weight`` only
as ``model.embed_tokens.weight``), and values are cast to the model's dtype, as
``load_state_dict`` would. Each stage's ``.safetensors`` is then written tensor by tensor
(:func:`write_streamed`: header first, then each tensor read from the checkpoint, written
and dropped), so the writer holds about one tensor, never a stage or the model.

Buffers come from the model itself (Note [parameters on meta, buffers real]): their real
values, kept by the tracer, are written whether or not a checkpoint is given (a checkpoint's
value wins for a persistent buffer). Without a checkpoint, parameters (and persistent
buffers without a value) are not written: ``load_stage`` initialises them
(:mod:`fxpipe.codegen.stage_init`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import InitModel
from fxpipe.codegen.stage_init import transformers_init_models
from fxpipe.codegen.graph.ownership import StageState, tensor_aliases
from fxpipe.errors import WeightsError
from fxpipe.graphmeta import BUFFER_VALUES_KEY, LIFTED_CONSTANT_PREFIX
from fxpipe.tracer.measure.meta import SKIPPED_ON_META
from fxpipe.userfiles import check_regular

if TYPE_CHECKING:
    from fxpipe.tracer.traced import TracedModel

__all__ = [
    "Checkpoint",
    "open_checkpoint",
    "MetaWeights",
    "meta_weights",
    "build_meta_weights",
    "meta_skipped_checks",
    "write_streamed",
    "write_meta_stage",
    "load_into_stage",
    "SKIPPED_SAFETY_NET",
]

SKIPPED_SAFETY_NET = (
    "safety net (the stages against the model, train and eval mode): a meta model holds no values; "
    "run `fxpipe verify` on a build made from a checkpoint"
)

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_INDEX_SUFFIX = ".safetensors.index.json"
_SHOWN = 5  # keys named per kind of problem


@dataclass
class Checkpoint:
    """A checkpoint's keys (shape each, read from headers) and a reader of one tensor.

    ``files`` maps each key to the file holding it. A safetensors tensor is read with one
    ``readinto`` from its byte range (``_ranges``: dtype, absolute offsets) into a tensor of its
    own: no file stays mapped, so reading holds the tensor and nothing else (Note [stage
    weights from a checkpoint])."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    files: dict[str, Path]
    _state: Mapping[str, torch.Tensor] | None = None  # a torch.save'd state dict (memory-mapped)
    _ranges: dict[str, tuple[torch.dtype, int, int]] = field(default_factory=dict)

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key``, read on its own."""
        if self._state is not None:
            return self._state[key]
        dtype, start, end = self._ranges[key]
        data = torch.empty(end - start, dtype=torch.uint8)
        with open(self.files[key], "rb") as f:
            f.seek(start)
            if f.readinto(data.numpy().data) != end - start:
                raise WeightsError(
                    f"--weights {self.files[key]}: tensor {key!r} is cut short; the file is damaged"
                )
        return data.view(dtype).reshape(self.shapes[key])


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a checkpoint (Note [stage weights from a checkpoint]) without reading its tensors."""
    path = Path(path)
    if path.is_dir():
        return _open_directory(path)
    check_regular(path, "--weights", WeightsError)  # Note [regular files only] in fxpipe.userfiles
    if not path.is_file():
        raise WeightsError(f"--weights {path}: no such file or directory")
    if path.suffix == ".safetensors":
        return _open_safetensors([path], path)
    return _open_torch_save(path)


def _open_directory(path: Path) -> Checkpoint:
    indexes = sorted(path.glob(f"*{_INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise WeightsError(
            f"--weights {path}: several index files ({[p.name for p in indexes]}); name one shard set"
        )
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsError(
                f"--weights {indexes[0]}: not a safetensors index ({type(exc).__name__}: {exc}); "
                'expected {"weight_map": {key: shard file}}'
            ) from None
        files = sorted({path / str(f) for f in weight_map.values()})
        return _open_safetensors(
            files, path, expected={k: path / str(f) for k, f in weight_map.items()}
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(
            f"--weights {path}: a directory with no *.safetensors files and no {_INDEX_SUFFIX}"
        )
    return _open_safetensors(files, path)


def _safetensors_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and where its data starts."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > file.stat().st_size - 8:
            raise ValueError(f"header of {size} bytes in a file of {file.stat().st_size}")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + size


def _open_safetensors(
    files: list[Path], path: Path, expected: dict[str, Path] | None = None
) -> Checkpoint:
    dtypes = {name: dtype for dtype, name in _ST_DTYPES.items()}
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    ranges: dict[str, tuple[torch.dtype, int, int]] = {}
    for file in files:
        check_regular(file, f"--weights {path}: shard", WeightsError)
        if not file.is_file():
            raise WeightsError(f"--weights {path}: shard {file.name} named by the index is missing")
        try:
            header, base = _safetensors_header(file)
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                if key in where:
                    raise WeightsError(
                        f"--weights {path}: key {key!r} is in both {where[key].name} and {file.name}"
                    )
                begin, end = entry["data_offsets"]
                shapes[key], where[key] = tuple(int(d) for d in entry["shape"]), file
                ranges[key] = (dtypes[entry["dtype"]], base + int(begin), base + int(end))
        except WeightsError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged header: any of JSON, key and type errors
            raise WeightsError(
                f"--weights {file}: not a readable safetensors file ({type(exc).__name__}: {exc})"
            ) from None
    if expected is not None:
        wrong = sorted(k for k, f in expected.items() if where.get(k) != f)
        if wrong:
            raise WeightsError(
                f"--weights {path}: the index places {wrong[:_SHOWN]} in shards that do not hold them"
            )
    return Checkpoint(path=path, shapes=shapes, files=where, _ranges=ranges)


def _open_torch_save(path: Path) -> Checkpoint:
    try:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle and zip errors alike
        raise WeightsError(
            f"--weights {path}: not a safetensors file and not loadable with torch.load("
            f"weights_only=True) ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise WeightsError(
            f"--weights {path}: holds a {type(state).__name__}, not a state dict of tensors; save "
            "model.state_dict()"
        )
    return Checkpoint(
        path=path,
        shapes={k: tuple(v.shape) for k, v in state.items()},
        files={k: path for k in state},
        _state=state,
    )


@dataclass(frozen=True)
class MetaWeights:
    """Where a meta build's tensors come from: ``key_of`` maps a model key to its checkpoint key
    (empty without a checkpoint), ``buffers`` holds the buffers' real values, ``init_models`` the
    transformers models whose ``_init_weights`` initialise the stages without a checkpoint."""

    checkpoint: Checkpoint | None
    key_of: Mapping[str, str]
    buffers: Mapping[str, torch.Tensor]
    init_models: tuple[InitModel, ...] = ()

    @property
    def source(self) -> str:
        """What the manifest records: ``"checkpoint"`` or ``"init"`` (Note [stage weights from a checkpoint])."""
        return "checkpoint" if self.checkpoint is not None else "init"


def meta_weights(
    model: nn.Module, buffers: Mapping[str, torch.Tensor], weights: str | Path | None
) -> MetaWeights:
    """Check ``weights`` against ``model`` and say where each key is read from (Note [stage weights from a
    checkpoint]); one :class:`WeightsError` line names every missing, unexpected or mis-shaped key."""
    if weights is None:
        return MetaWeights(None, {}, dict(buffers), transformers_init_models(model))
    checkpoint = open_checkpoint(weights)
    state = model.state_dict(keep_vars=True)
    groups = tensor_aliases(model)
    key_of: dict[str, str] = {}
    missing, misshaped = [], []
    for key, t in state.items():
        found = next((k for k in [key, *groups.get(id(t), [])] if k in checkpoint.shapes), None)
        if found is None:
            missing.append(key)
            continue
        key_of[key] = found
        if checkpoint.shapes[found] != tuple(t.shape):
            misshaped.append(f"{found} {list(checkpoint.shapes[found])} (model: {list(t.shape)})")
    known = {k for t in state.values() for k in groups.get(id(t), [])} | set(state)
    unexpected = sorted(set(checkpoint.shapes) - known)
    problems = [
        f"{what} {len(keys)} key{'s' if len(keys) > 1 else ''}: {', '.join(keys[:_SHOWN])}"
        f"{', …' if len(keys) > _SHOWN else ''}"
        for what, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", misshaped),
        )
        if keys
    ]
    if problems:
        raise WeightsError(
            f"--weights {checkpoint.path} does not fit {type(model).__name__}: {'; '.join(problems)}"
        )
    return MetaWeights(checkpoint, key_of, dict(buffers))


def load_into_stage(stages: Iterable[nn.Module], model: nn.Module, weights: str | Path) -> int:
    """Copy into each of ``stages`` (loaded stages of ``model``, same keys: one rank's) its tensors from
    the checkpoint ``weights``, one tensor at a time; the checkpoint is first checked, once, against the
    whole ``model`` (meta or real) as ``--weights`` is. Returns the number of tensors copied."""
    found = meta_weights(model, {}, weights)
    assert found.checkpoint is not None
    copied = 0
    with torch.no_grad():
        for stage in stages:
            for key, t in list(stage.named_parameters(remove_duplicate=False)) + list(
                stage.named_buffers()
            ):
                source = found.key_of.get(key)
                if source is not None:
                    t.copy_(found.checkpoint.tensor(source))
                    copied += 1
    return copied


def build_meta_weights(traced: TracedModel, weights: str | Path | None) -> MetaWeights | None:
    """Where the stages of ``traced`` get their tensors: ``None`` for a real model (from the model itself)."""
    if not traced.profile.meta:
        if weights is not None:
            raise WeightsError(
                f"--weights {weights} is for models traced on the meta device; add --device meta "
                "(or load the checkpoint in the model file)"
            )
        return None
    return meta_weights(traced.model, traced.graph_module.meta.get(BUFFER_VALUES_KEY, {}), weights)


def meta_skipped_checks(weights: MetaWeights | None) -> tuple[str, ...]:
    """The checks a meta build skips, with the reason (recorded in the manifest and printed)."""
    return () if weights is None else (*SKIPPED_ON_META, SKIPPED_SAFETY_NET)


def write_streamed(
    path: Path,
    entries: Iterable[
        tuple[str, torch.Size | tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]
    ],
    metadata: Mapping[str, str],
) -> None:
    """Write a safetensors file whose tensors are fetched one at a time: ``(key, shape, dtype, fetch)``.

    The header is written first (shapes and dtypes are known); each tensor is then fetched,
    checked, written and dropped, so at most one is held.
    """
    items = list(entries)
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for key, shape, dtype, _ in items:
        if dtype not in _ST_DTYPES:
            raise WeightsError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store")
        size = math.prod(int(d) for d in shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for key, shape, dtype, fetch in items:
            t = fetch().detach()
            if tuple(t.shape) != tuple(shape):
                raise WeightsError(
                    f"tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}"
                )
            t = t.to(device="cpu", dtype=dtype).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t


def write_meta_stage(state: StageState, path: Path, weights: MetaWeights) -> tuple[str, ...]:
    """Write a stage of a meta build (Note [stage weights from a checkpoint]); return the keys left for
    load-time initialisation (none with a checkpoint)."""
    entries: list[tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]] = []
    left: list[str] = []
    for e in state.stored:
        shape, dtype = tuple(e.tensor.shape), e.tensor.dtype
        if e.key in weights.key_of and weights.checkpoint is not None:
            entries.append(
                (e.key, shape, dtype, _reader(weights.checkpoint, weights.key_of[e.key]))
            )
        elif e.key in weights.buffers or not e.tensor.is_meta:
            value = weights.buffers.get(e.key, e.tensor)
            entries.append((e.key, shape, dtype, _constant(value)))
        elif weights.checkpoint is None and e.kind != "constant":
            left.append(e.key)
        elif e.key.startswith(LIFTED_CONSTANT_PREFIX):
            raise WeightsError(
                f"{e.key!r} is a tensor the model makes in forward from Python values (torch.tensor(...) "
                "or indexing with a list, e.g. x[..., [-2], :]); torch.export made it on the meta device, "
                "where its value is lost. Trace on cpu, or make it a buffer the model file builds on "
                "the CPU (fxpipe puts only parameters on meta)"
            )
        else:
            raise WeightsError(
                f"{e.key!r} is a {e.kind} with no value: the model built it on the meta device and "
                "no checkpoint holds it; let the model file build its buffers on the CPU (fxpipe puts "
                "only parameters on meta) or trace on cpu"
            )
    write_streamed(
        path, entries, {"format": "pt", "written_by": "fxpipe", "weights": weights.source}
    )
    return tuple(left)


def _constant(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: value


def _reader(checkpoint: Checkpoint, key: str) -> Callable[[], torch.Tensor]:
    return lambda: checkpoint.tensor(key)
