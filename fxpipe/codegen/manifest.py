"""``Manifest``: the contract between a build directory and whoever loads it.

A stage's ``forward`` takes ``StageManifest.inputs`` in order and returns a tuple in
the order of ``StageManifest.outputs``. A boundary tensor is produced by one stage
(``producer``; ``INPUT`` for a model input, which every rank reads itself) and consumed
by any later stages (``consumers``) and/or returned by the model (``model_output`` is
its position in the model's flattened output). Tensors may skip stages: they travel
straight from producer to consumer.

Reading a manifest checks every field against its type hint (``fxpipe.schema``): a
malformed one is refused with one ``BuildDirError`` naming the field, before anything
of the build is used. The current schema version and the one before it (whose builds have no
shared source) are read; an older build directory must be rebuilt.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

from fxpipe.errors import BuildDirError, ConfigError
from fxpipe.jsonio import check_schema_version, dump_json, load_json
from fxpipe.schema import NonNegInt, PositiveInt, read_dataclass
from fxpipe.shapeformula import BATCH, UNKNOWN, DimRange, bind_symbols, check_ranges, evaluate
from fxpipe.userfiles import check_regular
from fxpipe.tracer.call import CallSpec

__all__ = [
    "model_file_reference",
    "INPUT",
    "MANIFEST_SCHEMA_VERSION",
    "BoundaryTensor",
    "StageManifest",
    "Tie",
    "InitModel",
    "Manifest",
]

# 2: microbatches, training and torch_version are fields (were ``extra``); 3: each stage lists the
# inputs it changes in place (``mutated_inputs``): run without that list, such a stage changed a
# tensor that its producer or another stage still read; 4: classes several stages use live once in
# ``shared_source`` (hash ``shared_sha256``), which the stages with ``imports_shared`` import: an older
# fxpipe would import it unchecked, so it refuses version 4; this one reads version 3 (no shared file);
# 5: boundary tensors carry shape formulas (``dims``) and the build its dynamic dimensions
# (``dynamic``, Note [shape formulas]): an older fxpipe would size buffers at the traced shapes, so
# it refuses version 5; versions 3 and 4 read here as builds whose only dynamic dimension is the batch
MANIFEST_SCHEMA_VERSION = 5
OLDEST_MANIFEST_SCHEMA_VERSION = 3
INPUT = -1  # producer of a model input


_PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")


def _project_root(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` that looks like a project (a git checkout or a
    Python project)."""
    for folder in (path, *path.parents):
        if any((folder / marker).exists() for marker in _PROJECT_MARKERS):
            return folder
    return None


def model_file_reference(model_file: str | Path, build_dir: str | Path) -> str:
    """How a build directory names its model file: relative to the build directory when both
    live in one project (a git checkout or Python project), so they move together to another
    checkout or node; absolute otherwise, so the build directory can move on its own."""
    model, build = Path(model_file).resolve(), Path(build_dir).resolve()
    root = _project_root(build)
    if root is None or not model.is_relative_to(root):
        return str(model)
    return Path(os.path.relpath(model, build)).as_posix()


@dataclass(frozen=True)
class BoundaryTensor:
    """A tensor that crosses a stage boundary, with its shape at the traced microbatch."""

    name: str
    shape: tuple[NonNegInt, ...]
    dtype: str
    batch_dim: NonNegInt | None
    producer: int
    consumers: tuple[NonNegInt, ...] = ()
    requires_grad: bool = True
    model_output: NonNegInt | None = None
    dims: tuple[str, ...] | None = None  # each dimension's formula (Note [shape formulas])

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "consumers", tuple(self.consumers))
        if self.dims is not None:
            object.__setattr__(self, "dims", tuple(self.dims))
            if len(self.dims) != len(self.shape):
                raise BuildDirError(
                    f"tensor {self.name!r}: dims {list(self.dims)} do not match its shape {list(self.shape)}"
                )
        if self.producer < INPUT:
            raise BuildDirError(
                f"tensor {self.name!r}: producer {self.producer} is neither a stage index nor "
                f"{INPUT} (a model input)"
            )

    @property
    def data_dependent(self) -> bool:
        """Whether a dimension depends on the data (``"?"``): its shape travels with it."""
        return self.dims is not None and UNKNOWN in self.dims

    def fits(
        self,
        shape: Sequence[int],
        microbatch: int,
        traced_microbatch: int,
        sizes: Mapping[str, int] | None = None,
    ) -> bool:
        """Whether ``shape`` is this tensor's at the step's sizes: every dimension but the data's
        (``"?"``, which any size fits) from its formula."""
        if not self.data_dependent:
            return tuple(shape) == self.shape_at(microbatch, traced_microbatch, sizes)
        assert self.dims is not None
        if len(shape) != len(self.dims):
            return False
        bound = {BATCH: microbatch, **(sizes or {})}
        try:
            return all(
                f == UNKNOWN or evaluate(f, bound) == size for f, size in zip(self.dims, shape)
            )
        except KeyError:
            return False

    def expected_shape(
        self, microbatch: int, traced_microbatch: int, sizes: Mapping[str, int] | None = None
    ) -> tuple[int, ...] | None:
        """The shape this tensor must have at the step's sizes (``shape_at``), or None when a
        dimension depends on the data: then only ``fits`` can tell. What ``has_shape`` takes as
        ``want``; a caller computes it once per step's sizes and keeps it."""
        return None if self.data_dependent else self.shape_at(microbatch, traced_microbatch, sizes)

    def has_shape(
        self,
        shape: Sequence[int],
        want: tuple[int, ...] | None,
        microbatch: int,
        traced_microbatch: int,
        sizes: Mapping[str, int] | None = None,
    ) -> bool:
        """Whether a tensor of ``shape`` is this one at the step's sizes, ``want`` being
        ``expected_shape`` at those sizes: equal to it, or, data-dependent (``want`` None), one
        that ``fits``. The runtime's one check of a stage's outputs (``StageWorker.forward``)."""
        if want is not None:
            return shape == want  # a torch.Size equals the tuple of its sizes
        return self.fits(shape, microbatch, traced_microbatch, sizes)

    def shape_at(
        self, microbatch: int, traced_microbatch: int, sizes: Mapping[str, int] | None = None
    ) -> tuple[int, ...]:
        """The shape at another microbatch size (scaled along ``batch_dim``), and, given the step's
        ``sizes`` (symbol -> size), with every dimension from its formula (Note [shape formulas])."""
        if self.dims is not None and not self.data_dependent:
            bound = {BATCH: microbatch, **(sizes or {})}
            try:
                return tuple(evaluate(f, bound) for f in self.dims)
            except KeyError as missing:
                raise BuildDirError(
                    f"tensor {self.name!r}: its shape {list(self.dims)} needs the size {missing}, "
                    "which the step's inputs do not give"
                ) from None
        if self.batch_dim is None:
            return self.shape
        shape = list(self.shape)
        per_sample, rem = divmod(shape[self.batch_dim], traced_microbatch)
        if rem:
            raise BuildDirError(
                f"tensor {self.name!r}: dim {self.batch_dim} of {self.shape} "
                f"is not a multiple of the traced microbatch {traced_microbatch}"
            )
        shape[self.batch_dim] = per_sample * microbatch
        return tuple(shape)


@dataclass(frozen=True)
class StageManifest:
    """One stage: its files, hashes, the tensors it owns and its boundary."""

    index: NonNegInt
    class_name: str
    source: str
    weights: str
    source_sha256: str
    weights_sha256: str
    inputs: tuple[BoundaryTensor, ...]
    outputs: tuple[BoundaryTensor, ...]
    parameters: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    constants: tuple[
        str, ...
    ] = ()  # non-persistent buffers: in the weights file, not in state_dict()
    imports_model_file: bool = (
        False  # its source imports user classes from the model file (hash-checked too)
    )
    rank: NonNegInt | None = None  # the pipeline rank that runs this stage (chunk); None: its index
    mutated_inputs: tuple[
        str, ...
    ] = ()  # inputs it changes in place: each run gets copies of its own
    imports_shared: bool = (
        False  # its source imports classes from the build's shared source (hash-checked too)
    )

    def __post_init__(self) -> None:
        for name in (
            "inputs",
            "outputs",
            "parameters",
            "buffers",
            "units",
            "constants",
            "mutated_inputs",
        ):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        unknown = set(self.mutated_inputs) - {t.name for t in self.inputs}
        if unknown:
            raise BuildDirError(
                f"stage {self.index}: mutated_inputs {sorted(unknown)} are not inputs of the stage"
            )
        for name in (
            "source",
            "weights",
        ):  # files of the build directory itself, never a path out of it
            value = getattr(self, name)
            if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value:
                raise BuildDirError(
                    f"stage {self.index}: {name} {value!r} is not a file name inside the build "
                    "directory"
                )

    @property
    def pipeline_rank(self) -> int:
        """The pipeline rank that runs this stage: ``rank``, or its index in a build of one stage per rank."""
        return self.index if self.rank is None else self.rank


@dataclass(frozen=True)
class Tie:
    """One parameter held by several stages: ``keys[i]`` is its name on ``stages[i]``."""

    stages: tuple[NonNegInt, ...]
    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "keys", tuple(self.keys))
        if len(self.stages) != len(self.keys) or len(self.stages) < 2:
            raise BuildDirError(f"a tie needs one key per stage and at least two stages: {self}")


@dataclass(frozen=True)
class InitModel:
    """A transformers model whose ``_init_weights`` initialises the stage tensors under ``prefix``
    (Note [each stage initialises itself] in ``fxpipe.codegen.stage_init``): its class and its
    config's class as ``module:qualname``, and the config as JSON."""

    prefix: str
    model_class: str
    config_class: str
    config: str


@dataclass(frozen=True)
class Manifest:
    """Everything a loader needs to know about a build directory.

    ``microbatches`` is the number of microbatches per step the build was planned for
    (0 when constructed without one: ``batch_size // microbatch_size`` is filled in),
    ``training`` the mode the model was traced in, ``torch_version`` the torch that built it,
    ``plan_sha256`` the hash of ``plan.json`` (Note [check before use] in ``fxpipe.codegen.integrity``).
    ``call`` says how a call of the model binds to ``inputs`` (Note [the traced call] in
    ``fxpipe.tracer.call``; ``None``: positionally, in order: see ``call_spec``);
    ``output_modules`` are the modules to import before reading ``output_spec`` (Note
    [output structure] in ``fxpipe.codegen.outputs``).
    Its ``stages`` are the build's chunks: with ``--virtual-stages V`` each pipeline rank
    runs V of them (``StageManifest.rank``, placed loop- or V-style; ``stage_ranks``), and
    ``schedule`` names the schedule the build was planned for. ``weights`` says where the stage
    weights came from: the model (``"model"``), a checkpoint (``"checkpoint"``), or nowhere yet
    (``"init"``: ``load_stage`` initialises what the weights files leave out); ``skipped_checks``
    names the checks a meta build could not run, with the reason; ``recomputed_buffers`` the
    buffers a model built on the meta device held no value for, recomputed on the CPU and written
    to the stages, one line each saying how (Note [computed buffers on meta] in
    ``fxpipe.tracer.construct.meta_buffers``).
    """

    model_file: str
    model_fn: str
    model_sha256: str
    stages: tuple[StageManifest, ...]
    batch_size: PositiveInt
    microbatch_size: PositiveInt
    inputs: tuple[BoundaryTensor, ...] = ()
    ties: tuple[Tie, ...] = ()
    inputs_fn: str = "example_inputs"
    frontend: str = "symbolic"
    output_spec: str | None = None
    schema_version: int = MANIFEST_SCHEMA_VERSION
    microbatches: NonNegInt = 0
    training: bool = True
    torch_version: str = ""
    call: CallSpec | None = None
    output_modules: tuple[str, ...] = ()
    plan_sha256: str = (
        ""  # of plan.json ("" in builds without one, and in builds written before it was recorded)
    )
    schedule: str | None = None
    weights: str = (
        "model"  # "model" | "checkpoint" | "init" (Note [stage weights from a checkpoint])
    )
    skipped_checks: tuple[str, ...] = ()
    recomputed_buffers: tuple[str, ...] = ()
    init_models: tuple[
        InitModel, ...
    ] = ()  # with weights "init": transformers models that initialise their tensors
    shared_source: str = (
        ""  # the classes several stages use (Note [classes several stages share]); "" if none
    )
    shared_sha256: str = ""
    # the line that fixes the batch size: the stages are static, every microbatch holds exactly
    # microbatch_size samples (Note [a batch the model fixes] in fxpipe.tracer.frontend.static_batch)
    static_batch: str = ""

    def check_static_batch(self, microbatch: int) -> None:
        """Refuse a microbatch of another size than the one a static build was traced at (Note [a
        batch the model fixes] in :mod:`fxpipe.tracer.frontend.static_batch`); nothing for a dynamic build."""
        if self.static_batch and microbatch != self.microbatch_size:
            per_step = (
                f" (--batch-size {self.microbatch_size * self.microbatches} with "
                f"{self.microbatches} microbatches)"
                if self.microbatches
                else ""
            )
            raise ConfigError(
                f"this build takes microbatches of exactly {self.microbatch_size} samples, not "
                f"{microbatch}: {self.static_batch} fixes the model's batch size, so it was traced "
                f"static; feed {self.microbatch_size} samples per microbatch{per_step}"
            )

    dynamic: tuple[DimRange, ...] = ()  # the dimensions besides the batch that follow the data

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "dynamic", tuple(self.dynamic))
        object.__setattr__(self, "skipped_checks", tuple(self.skipped_checks))
        object.__setattr__(self, "recomputed_buffers", tuple(self.recomputed_buffers))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "ties", tuple(self.ties))
        object.__setattr__(self, "output_modules", tuple(self.output_modules))
        object.__setattr__(self, "init_models", tuple(self.init_models))
        if self.call is not None and len(self.call.inputs) != len(self.inputs):
            raise BuildDirError(
                f"the manifest's call names {len(self.call.inputs)} tensor inputs but it lists "
                f"{len(self.inputs)} model inputs"
            )
        if not self.microbatches:
            object.__setattr__(
                self, "microbatches", max(self.batch_size // self.microbatch_size, 1)
            )
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise BuildDirError(f"manifest stage {i} says it is stage {s.index}")
        if self.shared_source and (
            self.shared_source in (".", "..") or any(c in self.shared_source for c in "/\\\0")
        ):
            raise BuildDirError(
                f"shared_source {self.shared_source!r} is not a file name inside the build directory"
            )
        needing = [s.index for s in self.stages if s.imports_shared]
        if needing and not (self.shared_source and self.shared_sha256):
            raise BuildDirError(
                f"stages {needing} import the build's shared classes, but the manifest names no "
                "shared source with its sha256; rebuild the directory"
            )
        ranks = self.stage_ranks
        if ranks and (
            set(ranks) != set(range(max(ranks) + 1))
            or len(ranks) % (max(ranks) + 1)
            or any(ranks.count(r) != len(ranks) // (max(ranks) + 1) for r in set(ranks))
        ):
            raise BuildDirError(
                f"manifest stage ranks {list(ranks)} do not give every rank 0..{max(ranks)} the same "
                "number of stages; rebuild the directory"
            )

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The pipeline rank of every stage (chunk)."""
        return tuple(s.pipeline_rank for s in self.stages)

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks (processes per pipeline replica): the stages over ``virtual_stages``."""
        return 1 + max(self.stage_ranks, default=0)

    @property
    def virtual_stages(self) -> int:
        """Stages (chunks) each pipeline rank runs."""
        return max(1, self.num_stages // self.num_ranks)

    def model_path(self, build_dir: str | Path) -> Path:
        """The model file: ``model_file`` is stored relative to the build directory, so the
        two can move together (an absolute path, from older builds, is used as it is)."""
        path = Path(self.model_file)
        return path if path.is_absolute() else (Path(build_dir) / path).resolve()

    @property
    def call_spec(self) -> CallSpec:
        """How a call binds to the model inputs (``call``, else positionally in the inputs' order)."""
        return (
            self.call
            if self.call is not None
            else CallSpec.positional([t.name for t in self.inputs])
        )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage(self, index: int) -> StageManifest:
        if not 0 <= index < self.num_stages:
            raise BuildDirError(
                f"stage index {index} is out of range: this build has {self.num_stages} stages (0..{self.num_stages - 1})"
            )
        return self.stages[index]

    def data_dependent(self) -> list[str]:
        """One line per boundary tensor with a dimension that depends on the data (``"?"``), whose shape
        the runtime sends ahead of it (Note [data-dependent messages] in ``fxpipe.runtime.pipeline.stage_io``)."""
        lines = []
        for stage in self.stages:
            for o in stage.outputs:
                if o.data_dependent and o.consumers:
                    to = ", ".join(str(c) for c in o.consumers)
                    lines.append(
                        f"{o.name!r} {o.dtype}[{', '.join(o.dims or ())}] (stage {o.producer} to {to}): "
                        "its shape depends on the data and is sent ahead of it"
                    )
        return lines

    def step_sizes(
        self, shapes: Sequence[tuple[int, ...]], where: str = "this step"
    ) -> dict[str, int]:
        """The dynamic sizes of a step (``seq``: 32) read off its model inputs' shapes (in ``inputs``
        order), checked against the ranges the build holds for: a size outside is a ``ShapeError``
        before any message (Note [shape formulas]). Empty for a build without dynamic dimensions."""
        if not self.dynamic:
            return {}
        sizes = bind_symbols(shapes, [i.dims for i in self.inputs], where)
        sizes.pop(BATCH, None)
        check_ranges(sizes, self.dynamic, where)
        return sizes

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(asdict(self), path, what="manifest", error=BuildDirError)

    @classmethod
    def from_json(cls, path: str | Path) -> Manifest:
        """Read ``DIR/manifest.json`` (or a manifest file path, or its JSON text), refusing other
        schema versions and malformed fields with one ``BuildDirError``."""
        if isinstance(path, str) and path.lstrip().startswith("{"):
            what, data = "manifest", load_json(path, "manifest", BuildDirError)
        else:
            path = Path(path)
            if path.is_dir():
                path = path / "manifest.json"
            # a FIFO or a device: never read (it could block; Note [regular files only] in fxpipe.userfiles)
            check_regular(path, "manifest", BuildDirError, "rebuild with `fxpipe partition`")
            if not path.is_file():
                raise BuildDirError(
                    f"{str(path)!r} does not exist: is this a build directory written by "
                    "`fxpipe partition`?"
                )
            what = f"manifest {path}"
            data = load_json(path, what, BuildDirError)
        if "schema_version" not in data:
            raise BuildDirError(
                f"{what} has no schema_version; rebuild it with this fxpipe's `fxpipe partition`"
            )
        check_schema_version(
            data,
            MANIFEST_SCHEMA_VERSION,
            what,
            BuildDirError,
            oldest=OLDEST_MANIFEST_SCHEMA_VERSION,
            remedy="rebuild it with this fxpipe's `fxpipe partition`",
        )
        manifest = read_dataclass(cls, data, what, BuildDirError)
        if not manifest.stages:
            raise BuildDirError(f"{what} lists no stages; rebuild it with `fxpipe partition`")
        return manifest
