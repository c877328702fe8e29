"""Checkpoints keyed by the original model, written with ``torch.distributed.checkpoint``: any layout reads them.

Note [checkpoints keyed by the model]: a rank's stages hold the original model's tensors under
their original ``state_dict`` keys (``fxpipe.codegen.graph.ownership``), so a checkpoint can be
written in the model's own terms instead of the layout's. Every rank hands DCP one flat state
dict (``get_state_dict`` over its stages, FSDP's DTensor shards as they are):

- ``model.<key>``: parameters and persistent buffers;
- ``optim.<key>.<name>``: the optimizer's state of parameter ``<key>`` (Adam's ``exp_avg``,
  ``exp_avg_sq``, ``step``; SGD's ``momentum_buffer``); under ZeRO each rank its own shard;
- ``optim.param_groups``, ``scheduler``, ``scaler``, ``train`` (step, samples consumed, the
  record so far): plain data as JSON strings, the same on every rank;
- ``rng.<rank>.torch`` / ``rng.<rank>.python`` (``.cuda``, ``.numpy``): each rank's own streams
  (Note [numpy's stream in a checkpoint] in ``fxpipe.runtime.train.numpy_rng``).

Note [RNG streams by stage]: torch's and Python's generators (and CUDA's) are per process, so
they are stored per saving rank, with ``meta["rng"]`` saying what each rank's streams drew for
(``rng_key``): the stages it held (and their code), its replica and tensor-parallel rank out of
how many, the microbatches per step, the schedule when the rank holds several stages (it orders
their draws) and the device. A resuming rank continues the streams of the saving rank with its
own key, whatever else changed (another ``--shard`` level, another schedule for one stage per
rank, other ranks for other stages), so dropout draws the masks one run would; a rank without
a match keeps the streams it started with, and the resume names its stages in the log.

A tensor reachable under several keys (tied weights: GPT's ``wte.weight`` and
``lm_head.weight``, in one stage as aliases or in two as a ``Tie``) is stored once, under the
first of its keys in sorted order (``key_names``: the union over the world of the ranks'
alias groups and the manifest's ties, the same in every layout); ``meta["aliases"]`` maps
the others to it. DCP's planner writes each key once (replicas and the ranks holding a tie
offer the same key; ``dedup_save_plans`` keeps one writer, spread over the ranks) and each rank
writes its own file, nothing gathered. A load gives DCP this rank's state dict in the new
layout, so each rank reads only the tensors (and the shards of them) its stages hold.

Commit (the design of ``fxpipe.runtime.train.commit``, Note [checkpoint commit]): DCP writes
into a hidden staging folder ``.dcp-<id>.fxpipe-tmp``; when every rank has written (DCP's
save raises on all ranks when one fails), rank 0 renames it to ``dcp-<id>`` and replaces
``checkpoint.json`` (the commit point), whose ``parts`` name each file with its sha256 and size
and whose ``meta`` says ``"format": "dcp"``, the layout, the samples consumed and the global
batch; the previous checkpoint's folder is removed after. A load checks the files' sizes and
the sha256 of DCP's ``.metadata`` (not of the tensor files: that would read every rank's
tensors on every rank), and reads the ``dcp-<id>`` its record names, never a staging folder.

Non-tensor values are read back with ``torch.load(weights_only=True)`` (``_PlainLoadPlanner``):
a checkpoint holds plain data only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from fxpipe.errors import CheckpointError
from fxpipe.runtime.train.numpy_rng import numpy_rng_state, set_numpy_rng_state
from fxpipe.runtime.train.commit import CommitRecord, Part, new_token, read_record, write_record
from fxpipe.userfiles import open_regular

if TYPE_CHECKING:
    import torch.nn as nn

    from fxpipe.codegen.manifest import Manifest
    from fxpipe.runtime.pipeline.runner import PipelineRunner

__all__ = [
    "DCP_FORMAT",
    "DcpState",
    "alias_groups",
    "canonical_names",
    "check_dcp_keys",
    "commit_dcp",
    "dcp_folder",
    "describe_rng_key",
    "file_digest",
    "is_dcp",
    "key_names",
    "layout_of",
    "load_dcp_checkpoint",
    "read_model_state",
    "read_tensors",
    "rng_key",
    "rng_source",
    "runner_rng_key",
    "save_dcp_checkpoint",
    "staging_folder",
]

DCP_FORMAT = "dcp"
RECORD_NAME = "checkpoint.json"
_STAGING = ".dcp-{}.fxpipe-tmp"
_LOAD = StateDictOptions(strict=False)


def is_dcp(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint record's ``meta`` is of this format (else the per-rank files of ``checkpoint.py``)."""
    return meta.get("format") == DCP_FORMAT


def dcp_folder(directory: str | Path, record: CommitRecord) -> Path:
    """The DCP folder the committed ``record`` names."""
    return Path(directory) / str(record.meta["dcp_dir"])


class _PlainLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor values with ``weights_only=True`` (they are JSON strings)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        checked = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), checked)  # refuses anything but plain data
        checked.seek(0)
        super().load_bytes(read_item, checked)


# -- names -----------------------------------------------------------------------------------------


def _gather(mine: Any, doing: str) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, mine)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{doing}: another rank did not answer ({str(exc).strip()[:200]})"
        ) from None
    return out


def _fqn_keys(runner: PipelineRunner) -> dict[str, str]:
    """``runner.stage``'s state-dict names -> the original model's keys (a rank of several stages
    holds them in a ``ModuleList``: ``<i>.<key>``)."""
    if len(runner.stages) == 1:
        return {k: k for k in runner.stage.state_dict()}
    return {
        f"{i}.{k}": k
        for i, s in enumerate(sorted(runner.stages))
        for k in runner.stages[s].state_dict()
    }


def alias_groups(modules: dict[int, nn.Module], manifest: Manifest) -> list[list[str]]:
    """The groups of original keys one rank knows to name one tensor: the manifest's ties and the
    aliases inside its stages (``modules``, ties on the rank shared)."""
    groups: list[list[str]] = [list(t.keys) for t in manifest.ties]
    by_id: dict[int, list[str]] = {}
    for module in modules.values():
        for name, t in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]:
            by_id.setdefault(id(t), []).append(name)
    groups += [sorted(set(names)) for names in by_id.values() if len(set(names)) > 1]
    return groups


def canonical_names(everyone: list[list[list[str]]], keys: set[str]) -> dict[str, str]:
    """``keys`` and every key of the ranks' alias groups (``everyone``) -> the first key of its
    group (the union over the ranks) in sorted order, the one its tensor is stored under."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.get(k, k) != k:
            k = parent[k]
        return k

    for mine in everyone:
        for group in mine:
            roots = sorted({find(k) for k in group})
            for r in roots[1:]:
                parent[r] = roots[0]
    return {k: find(k) for k in keys | set(parent)}


def key_names(runner: PipelineRunner) -> dict[str, str]:
    """Every original key a stage of this layout holds -> the key its tensor is stored under (Note
    [checkpoints keyed by the model]). Collective over the world."""
    groups = alias_groups(runner.stages, runner.manifest)
    everyone = _gather(groups, "naming the checkpoint's tensors")
    return canonical_names(everyone, set(_fqn_keys(runner).values()))


def stored_names(names: dict[str, str], stored: Any, aliases: dict[str, str]) -> dict[str, str]:
    """``names`` (key -> the key this layout would store it under) resolved against a checkpoint
    another layout wrote: a tied tensor is read under whichever of its names the checkpoint
    holds it (``stored``: DCP's metadata keys; ``aliases``: the saving layout's alias map). A
    layout may know fewer names of a tie than another (one stage holding GPT-2's
    ``transformer.wte.weight`` and ``lm_head.weight`` may use only the first)."""
    groups: dict[str, list[str]] = {}
    for k, c in names.items():
        groups.setdefault(c, []).append(k)
    chosen: dict[str, str] = {}
    for c, group in groups.items():
        found = c
        for k in [c, *sorted(group)]:
            if f"model.{k}" in stored:
                found = k
                break
            if k in aliases and f"model.{aliases[k]}" in stored:
                found = aliases[k]
                break
        chosen[c] = found
    return {k: chosen[c] for k, c in names.items()}


def layout_of(runner: PipelineRunner) -> dict[str, Any]:
    """What names a layout: stages, their ranks, replicas, schedule and sharding."""
    dp = runner.data_parallel
    return {
        "num_stages": runner.manifest.num_stages,
        "stage_ranks": list(runner.manifest.stage_ranks),
        "world_size": runner.world_size,
        "replicas": runner.layout.replicas,
        "schedule": runner.schedule.name,
        "shard": dp.options.shard if dp is not None else "none",
        # only where there is tensor parallelism: older records compare equal without it
        **(
            {"tensor_parallel": runner.layout.tensor_parallel}
            if runner.layout.tensor_parallel > 1
            else {}
        ),
    }


def describe_layout(layout: dict[str, Any]) -> str:
    shard = f", shard {layout['shard']}" if layout.get("shard", "none") != "none" else ""
    tp = f" x tp {layout['tensor_parallel']}" if layout.get("tensor_parallel", 1) > 1 else ""
    return (
        f"{layout['num_stages']} stages on {len(set(layout['stage_ranks']))} ranks{tp} x "
        f"{layout['replicas']} replicas ({layout['schedule']}{shard})"
    )


# -- one rank's flat state dict ---------------------------------------------------------------------


@dataclass
class DcpState:
    """This rank's state as DCP sees it (``flat``) and the torch state dicts it came from."""

    flat: dict[str, Any]
    model: dict[str, Any]  # runner.stage's names -> tensors
    optim: dict[str, Any]  # torch's name-keyed optimizer state dict ({} without an optimizer)
    names: dict[str, str]  # runner.stage's names -> stored keys


def _zero_named(runner: PipelineRunner, zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """ZeRO's own shard of the state by ``runner.stage``'s names (first name of each parameter)."""
    names = {id(p): n for n, p in runner.stage.named_parameters()}
    if not zero.optim.state:  # DCP loads in place: the lazy state must exist first
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(zero.optim)
    return {
        "state": {names[id(p)]: s for p, s in zero.optim.state.items()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups],
    }


def _state(runner: PipelineRunner, names: dict[str, str]) -> DcpState:
    optimizer = runner.optimizer
    fqn = {f: names[k] for f, k in _fqn_keys(runner).items()}
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        msd: dict[str, Any] = dict(runner.stage.state_dict())
        osd = _zero_named(runner, optimizer)
    elif optimizer is not None:
        msd, osd = get_state_dict(runner.stage, [optimizer])
    else:
        msd, osd = dict(runner.stage.state_dict()), {}  # a stage without parameters, maybe empty
    flat: dict[str, Any] = {}
    for name, value in msd.items():
        flat.setdefault(f"model.{fqn[name]}", value)
    for name, per_param in (osd.get("state") or {}).items():
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                flat.setdefault(f"optim.{fqn[name]}.{k}", v)
    if osd:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
        flat["optim.param_groups"] = json.dumps(groups)
    return DcpState(flat, msd, osd, fqn)


def rng_key(
    stages: list[int],
    manifest: Manifest,
    replica: tuple[int, int],
    tp: tuple[int, int],
    microbatches: int,
    schedule: str | None,
    device: str,
) -> str:
    """What one rank's RNG streams draw for (Note [RNG streams by stage]): its stages (their
    code), its replica and tensor-parallel rank (each of how many), the microbatches of a step
    and, with several stages on the rank, the schedule that orders their draws."""
    return json.dumps(
        {
            "stages": stages,
            "num_stages": manifest.num_stages,
            "code": [manifest.stages[s].source_sha256 for s in stages],
            "replica": list(replica),
            "tp": list(tp),
            "microbatches": microbatches,
            "schedule": schedule if len(stages) > 1 else None,
            "device": device,
        },
        sort_keys=True,
    )


def runner_rng_key(runner: PipelineRunner) -> str:
    """``rng_key`` of ``runner``'s rank."""
    return rng_key(
        sorted(runner.stages),
        runner.manifest,
        (runner.replica, runner.layout.replicas),
        (runner.tp_rank, runner.layout.tensor_parallel),
        runner.schedule.num_microbatches,
        runner.schedule.name,
        runner.device.type,
    )


def describe_rng_key(key: str) -> str:
    """``rng_key``'s stages, as the log names them."""
    stages = json.loads(key)["stages"]
    return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def _plain(
    runner: PipelineRunner, step: int, samples: int, history: dict[str, Any]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "train": json.dumps({"step": step, "samples": samples, "history": history}),
        f"rng.{runner.rank}.torch": torch.get_rng_state(),
        f"rng.{runner.rank}.python": json.dumps(random.getstate()),
    }
    if runner.device.type == "cuda":
        out[f"rng.{runner.rank}.cuda"] = torch.cuda.get_rng_state(runner.device)
    numpy_state = numpy_rng_state()  # Note [numpy's stream in a checkpoint]
    if numpy_state is not None:
        out[f"rng.{runner.rank}.numpy"] = numpy_state
    if runner.scheduler is not None:
        out["scheduler"] = json.dumps(runner.scheduler.state_dict())
    if runner.scaler is not None:
        out["scaler"] = json.dumps(runner.scaler.scaler.state_dict())
    return out


def local_tensors(runner: PipelineRunner) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by original key, FSDP's shards as local tensors (no collective)."""
    return {
        k: v.to_local() if isinstance(v, DTensor) else v for k, v in runner.state_dict().items()
    }


# -- save ------------------------------------------------------------------------------------------


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256, size) of the regular file ``path``."""
    h, size = hashlib.sha256(), 0
    # a FIFO in a file's place is refused, never waited on (Note [regular files only] in fxpipe.userfiles)
    with os.fdopen(open_regular(path, "checkpoint file", CheckpointError), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _clean(directory: Path, keep: set[str]) -> None:
    """Remove DCP folders and staging folders of this checkpoint directory but ``keep``."""
    for child in directory.iterdir():
        name = child.name
        stale = (name.startswith(("dcp-", ".dcp-"))) and name not in keep
        if stale and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)


def staging_folder(directory: Path, token: str) -> Path:
    """The hidden folder DCP writes a checkpoint with id ``token`` into before its commit."""
    return directory / _STAGING.format(token)


def commit_dcp(
    directory: Path,
    staging: Path,
    token: str,
    files: dict[str, tuple[str, int]],
    meta: dict[str, Any],
) -> None:
    """Commit the DCP folder ``staging`` (every rank's ``files``: name -> (sha256, size)) as the
    checkpoint of ``directory``, with ``meta`` in its record; the previous one's folder is removed
    after (Note [checkpoint commit])."""
    final = f"dcp-{token}"
    parts = {
        name: Part(file=f"{final}/{name}", sha256=sha, bytes=size, pending="")
        for name, (sha, size) in files.items()
    }
    os.replace(staging, directory / final)
    record = CommitRecord(
        id=token,
        partial=True,
        num_parts=len(parts),
        parts=parts,
        meta={**meta, "format": DCP_FORMAT, "dcp_dir": final},
    )
    write_record(directory / RECORD_NAME, record, token)  # the commit point
    _clean(directory, keep={final})
    for old in directory.glob("rank_*.pt"):  # a run resumed from the per-rank format
        old.unlink(missing_ok=True)


def save_dcp_checkpoint(
    directory: str | Path,
    runner: PipelineRunner,
    step: int,
    samples: int,
    history: dict[str, Any],
    meta: dict[str, Any],
) -> None:
    """Write this rank's part of a checkpoint after ``step`` into ``directory`` and commit it with the
    others' (collective over the world; Note [checkpoints keyed by the model])."""
    directory = Path(directory)
    names = key_names(runner)
    token = _gather(new_token() if runner.rank == 0 else None, "starting a checkpoint")[0]
    staging = staging_folder(directory, token)
    state = _state(runner, names)
    flat = {**state.flat, **_plain(runner, step, samples, history)}
    try:
        dcp.save(
            flat,
            storage_writer=dcp.FileSystemWriter(staging, sync_files=True),
            process_group=None,
            no_dist=not dist.is_initialized(),
        )
        error = None
    except Exception as exc:  # noqa: BLE001 (DCP raises on every rank when one fails)
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    mine: dict[str, Any] = {"error": error, "files": {}, "rng": runner_rng_key(runner)}
    if error is None and staging.is_dir():
        for f in sorted(staging.iterdir()):
            if f.name == ".metadata" and runner.rank != 0:
                continue
            if f.name == ".metadata" or f.name.startswith(f"__{runner.rank}_"):
                mine["files"][f.name] = file_digest(f)
    everyone = _gather(mine, f"saving a checkpoint into {directory}")
    failed = next((m["error"] for m in everyone if m["error"]), None)
    if failed is not None:
        if runner.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(
            f"saving a checkpoint into {directory} failed: {failed}; the previous checkpoint (if "
            "any) is unchanged"
        )
    if runner.rank == 0:
        files = {name: v for m in everyone for name, v in m["files"].items()}
        commit_dcp(
            directory,
            staging,
            token,
            files,
            {
                **meta,
                "samples": samples,
                "layout": layout_of(runner),
                "aliases": {k: v for k, v in sorted(names.items()) if k != v},
                "rng": {str(r): m["rng"] for r, m in enumerate(everyone)},
            },
        )
    _gather(None, f"committing the checkpoint in {directory}")


# -- load ------------------------------------------------------------------------------------------


def _open(directory: Path, record: CommitRecord) -> dcp.FileSystemReader:
    folder = dcp_folder(directory, record)
    for name, part in record.parts.items():
        path = directory / part.file
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} is missing, but its record says it was saved"
            ) from None
        if size != part.bytes or (name == ".metadata" and file_digest(path)[0] != part.sha256):
            raise CheckpointError(
                f"{path} does not match its checkpoint record (sha256 or size differ): the file "
                "is corrupted or belongs to another save; refusing to load it"
            )
    return dcp.FileSystemReader(folder)


def check_dcp_keys(runner: PipelineRunner, directory: str | Path, record: CommitRecord) -> None:
    """Refuse, on every rank and before any step, a checkpoint whose model does not fit this layout's:
    a key missing on either side, or another shape (Note [what a resume carries over])."""
    directory = Path(directory)
    problem = None
    mine: set[str] = set()
    aliases: dict[str, str] = {}
    try:
        stored = _open(directory, record).read_metadata().state_dict_metadata
        aliases = dict(record.meta.get("aliases") or {})
        names = stored_names(key_names(runner), stored, aliases)
        for name, value in _state(runner, names).model.items():
            key = names[_fqn_keys(runner)[name]]
            mine.add(key)
            md = stored.get(f"model.{key}")
            if not isinstance(md, TensorStorageMetadata):
                problem = f"it has no {key!r}"
                break
            if tuple(md.size) != tuple(value.shape):
                problem = (
                    f"{key!r} has shape {tuple(md.size)} there and {tuple(value.shape)} in this "
                    "build"
                )
                break
    except CheckpointError as exc:
        problem = str(exc)
        stored = {}
    everyone = _gather((problem, sorted(mine)), f"checking the checkpoint in {directory}")
    bad = next((p for p, _ in everyone if p), None)
    if bad is None:
        held = {k for _, keys in everyone for k in keys}
        extra = sorted(
            k[6:]
            for k in stored
            if k.startswith("model.") and k[6:] not in held and k[6:] not in aliases.values()
        )
        if extra:
            bad = f"it holds {extra[:4]}, which no stage of this build has"
    if bad is not None:
        raise CheckpointError(
            f"--resume-from {directory}: the checkpoint does not fit this model: {bad}; resume a "
            "build partitioned from the same model file"
        )


def load_dcp_checkpoint(
    runner: PipelineRunner, directory: str | Path, record: CommitRecord
) -> dict[str, Any]:
    """Load the committed checkpoint in ``directory`` into ``runner`` (this rank reads only its
    tensors; collective over the world); returns ``{"step", "samples", "history", "rng"}`` where
    ``rng`` names the stages (over the world) whose RNG streams were not restored (Note [RNG
    streams by stage]); empty when every rank's were."""
    directory = Path(directory)
    reader = _open(directory, record)
    stored = reader.read_metadata().state_dict_metadata
    names = stored_names(key_names(runner), stored, dict(record.meta.get("aliases") or {}))
    state = _state(runner, names)
    flat = dict(state.flat)
    unsaved = {k for k in flat if k.startswith("optim.") and k not in stored}
    for k in unsaved:  # a parameter that had no optimizer state (never stepped)
        del flat[k]
    source = rng_source(dict(record.meta), runner)
    own = f"rng.{runner.rank}."
    for k, v in _plain(runner, 0, 0, {}).items():
        if k.startswith(own):  # this rank continues the streams of the saving rank ``source``
            if source is None:
                continue
            k = f"rng.{source}.{k[len(own) :]}"
        if k in stored:
            flat[k] = "" if isinstance(v, str) else v
    flat = {k: v for k, v in flat.items() if k in stored}
    dcp.load(
        flat,
        storage_reader=reader,
        planner=_PlainLoadPlanner(),
        process_group=None,
        no_dist=not dist.is_initialized(),
    )
    model = {name: flat[f"model.{key}"] for name, key in state.names.items() if name in state.model}
    optimizer = runner.optimizer
    if optimizer is not None and "optim.param_groups" in flat:
        saved_groups = json.loads(flat["optim.param_groups"])
        groups = optimizer.param_groups
        for group, saved in zip(groups, saved_groups):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        runner.stage.load_state_dict(model)
        keep = {
            n
            for n in state.optim["state"]
            if any(k.startswith(f"optim.{state.names[n]}.") for k in flat)
        }
        by_name = {id(p): n for n, p in runner.stage.named_parameters()}
        for p in [p for p in optimizer.optim.state if by_name[id(p)] not in keep]:
            del optimizer.optim.state[p]
    else:
        osd: dict[str, Any] = {}
        if optimizer is not None:
            groups = json.loads(flat.get("optim.param_groups", "[]")) or []
            per_param = {
                n: {
                    k: flat[f"optim.{state.names[n]}.{k}"]
                    for k in s
                    if f"optim.{state.names[n]}.{k}" in flat
                }
                for n, s in state.optim["state"].items()
            }
            osd = {
                "state": {n: s for n, s in per_param.items() if s},
                "param_groups": [
                    {**g, **{k: tuple(v) if k == "betas" else v for k, v in saved.items()}}
                    for g, saved in zip(state.optim["param_groups"], groups or [{}])
                ],
            }
        if optimizer is None:  # loaded in place; nothing else to set
            runner.stage.load_state_dict(model)
        else:
            set_state_dict(
                runner.stage,
                [optimizer],
                model_state_dict=model,
                optim_state_dict=osd,
                options=_LOAD,
            )
            saved_names = set(osd["state"])
            for name, p in runner.stage.named_parameters():
                if name not in saved_names:
                    optimizer.state.pop(p, None)
    if runner.scheduler is not None and "scheduler" in flat:
        runner.scheduler.load_state_dict(json.loads(flat["scheduler"]))
    if runner.scaler is not None and "scaler" in flat:
        runner.scaler.scaler.load_state_dict(json.loads(flat["scaler"]))
    rng = f"rng.{source}.torch" in flat
    if rng:
        torch.set_rng_state(flat[f"rng.{source}.torch"])
        version, internal, gauss = json.loads(flat[f"rng.{source}.python"])
        random.setstate((version, tuple(internal), gauss))
        if f"rng.{source}.cuda" in flat and runner.device.type == "cuda":
            torch.cuda.set_rng_state(flat[f"rng.{source}.cuda"], runner.device)
        if f"rng.{source}.numpy" in flat:  # a checkpoint written before it has none
            set_numpy_rng_state(flat[f"rng.{source}.numpy"])
    lost = _gather(
        None if rng else describe_rng_key(runner_rng_key(runner)), "restoring the RNG streams"
    )
    train = json.loads(flat["train"])
    return {**train, "rng": tuple(sorted({d for d in lost if d is not None}))}


def rng_source(meta: dict[str, Any], runner: PipelineRunner) -> int | None:
    """The saving rank whose RNG streams ``runner``'s rank continues (Note [RNG streams by
    stage]): the one whose ``rng_key`` is this rank's; ``None`` when none is. A checkpoint
    without the keys (written before them) restores only into the layout that saved it."""
    keys = meta.get("rng")
    if not isinstance(keys, dict):
        return runner.rank if meta.get("layout") == layout_of(runner) else None
    mine = runner_rng_key(runner)
    return next(
        (int(r) for r, k in sorted(keys.items(), key=lambda x: int(x[0])) if k == mine), None
    )


# -- out of the pipeline ---------------------------------------------------------------------------


def read_tensors(directory: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The whole tensors stored under ``prefix`` (``"model."``, ``"optim."``) in the committed
    checkpoint in ``directory``, by the rest of their names; in this process, no job started."""
    directory = Path(directory)
    record = read_record(directory / RECORD_NAME)
    if record is None or not is_dcp(dict(record.meta)):
        raise CheckpointError(f"{directory} holds no checkpoint of the model-keyed (DCP) format")
    reader = _open(directory, record)
    stored = reader.read_metadata().state_dict_metadata
    state: dict[str, Any] = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in stored.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process, on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=_PlainLoadPlanner(), no_dist=True)
    return {k[len(prefix) :]: v for k, v in state.items()}


def read_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict (every key, tied ones each under all their names) from the
    committed checkpoint in ``directory``, in this process, no job started."""
    out = read_tensors(directory, "model.")
    record = read_record(Path(directory) / RECORD_NAME)
    assert record is not None
    for alias, key in dict(record.meta.get("aliases") or {}).items():
        out[alias] = out[key]
    return out
