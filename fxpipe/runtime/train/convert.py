"""``fxpipe checkpoint convert OLD NEW --build BUILD``: per-rank files into the model-keyed format.

Note [converting per-rank checkpoints]: a checkpoint of an older fxpipe (``OLD/rank_<r>.pt``,
``fxpipe.runtime.train.checkpoint``) holds each rank's stages under the original model's keys
(FSDP's shards gathered whole), but its optimizer state is torch's, keyed by the position of a
parameter in the rank's optimizer. The build that wrote it names those positions: each
pipeline rank's stages are loaded (on the CPU, one rank at a time, ties on a rank shared as
the runner shares them) and ``[p for p in rank_module.parameters() if p.requires_grad]`` is the
list the optimizer was made over (``stage_optimizer``), so position ``i`` is that list's ``i``-th
parameter, by its original key. The same modules give the tied keys (``alias_groups``), so a
tied tensor is stored once, as a run stores it (Note [checkpoints keyed by the model]).

One process writes what a run's ranks would: ``model.<key>`` and ``optim.<key>.<name>`` from
replica 0's parts (replicas hold the same state), the optimizer's hyperparameters, the
schedule's position, the loss scale, the step, the samples consumed (the old data position in
steps times the global batch) and every rank's RNG streams with the key of what they drew for
(Note [RNG streams by stage]; a rank of several stages gets no key, since the record does not
say which schedule ordered their draws). ``NEW`` is committed whole or not at all with the
same record as a run's checkpoint; ``OLD`` is left as it is. The build must be the one whose
run wrote ``OLD`` (its manifest's sha256, when the record names one).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from fxpipe.codegen import load_stage
from fxpipe.codegen.load import read_manifest
from fxpipe.errors import CheckpointError
from fxpipe.runtime.pipeline.rank_stages import load_rank_stages, rank_module
from fxpipe.runtime.train.checkpoint import RECORD_NAME, read_part
from fxpipe.runtime.train.commit import new_token, read_record
from fxpipe.runtime.train.dcp_checkpoint import (
    alias_groups,
    canonical_names,
    commit_dcp,
    file_digest,
    is_dcp,
    rng_key,
    staging_folder,
)
from fxpipe.runtime.train.resume import build_identity
from fxpipe.runtime.train.run_record import build_sha256

__all__ = ["convert_checkpoint"]


def _check_new(new: Path) -> None:
    if new.exists() and (not new.is_dir() or any(new.iterdir())):
        raise CheckpointError(
            f"{str(new)!r} exists and is not an empty directory; name a new directory for the "
            "converted checkpoint"
        )


def _rank_params(
    build: Path, manifest: Any, pipeline_rank: int
) -> tuple[dict[int, Any], list[str]]:
    """(the pipeline rank's stage modules, ties shared; the original keys of its optimizer's
    parameters in the optimizer's order)."""
    modules = load_rank_stages(
        manifest, pipeline_rank, lambda s, d: load_stage(build, s, device=d), torch.device("cpu")
    )
    keys = []
    for name, p in rank_module(modules).named_parameters():  # the optimizer's list, in order
        if p.requires_grad:
            # several stages are a ModuleList, whose names are "<i>.<original key>"
            keys.append(name.partition(".")[2] if len(modules) > 1 else name)
    return modules, keys


def convert_checkpoint(old: str | Path, new: str | Path, build: str | Path | None) -> str:
    """Write the per-rank checkpoint in ``old`` as a model-keyed checkpoint into the new
    directory ``new`` (Note [converting per-rank checkpoints]); returns what the log says."""
    old, new = Path(old), Path(new)
    if build is None:
        raise CheckpointError(
            "fxpipe checkpoint convert needs --build BUILD, the build directory whose run wrote "
            f"{old} (its stages name the optimizer's parameters)"
        )
    build = Path(build)
    record = read_record(old / RECORD_NAME) if old.is_dir() else None
    if record is None:
        raise CheckpointError(
            f"{str(old)!r} holds no checkpoint (no {RECORD_NAME}); name the --checkpoint-dir of a run"
        )
    if is_dcp(dict(record.meta)):
        raise CheckpointError(
            f"{old} already holds a model-keyed checkpoint: resume it with --resume-from {old}"
        )
    _check_new(new)
    manifest = read_manifest(build)
    identity = build_identity(manifest, build_sha256(build))
    meta = dict(record.meta)
    wrote = dict(meta.get("build") or {}).get("manifest_sha256")
    if wrote and wrote != identity["manifest_sha256"]:
        raise CheckpointError(
            f"--build {build} is not the build whose run wrote {old} (its manifest.json differs "
            "from the one the checkpoint names); give the build directory the run trained"
        )
    parts = {int(r): read_part(old, int(r), record) for r in record.parts}
    world = len(parts)
    replicas = len({p["replica"] for p in parts.values()})
    settings = dict(meta.get("settings") or {})
    microbatches = int(settings.get("microbatches") or manifest.microbatches or 1)
    batch = int(settings.get("batch_size") or manifest.batch_size)
    first = parts[min(parts)]
    flat: dict[str, Any] = {}
    groups: list[list[str]] = []
    keys: set[str] = set()
    optim: dict[str, dict[str, Any]] = {}
    for r in sorted(parts):
        part = parts[r]
        if part["replica"] != 0:
            continue
        modules, order = _rank_params(build, manifest, int(part["pipeline_rank"]))
        groups += alias_groups(modules, manifest)
        keys |= set(part["model"])
        osd = part["optimizer"] or {}
        ids = [i for g in osd.get("param_groups", []) for i in g["params"]]
        if osd and len(ids) != len(order):
            raise CheckpointError(
                f"rank {r}'s optimizer in {old} steps {len(ids)} parameters, but its stages in "
                f"{build} train {len(order)}: it was written by another build"
            )
        for position, i in enumerate(ids):
            optim.setdefault(order[position], osd.get("state", {}).get(i, {}))
        if osd and "optim.param_groups" not in flat:
            flat["optim.param_groups"] = json.dumps(
                [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
            )
        del modules
    names = canonical_names([groups], keys)
    for r in sorted(parts):
        if parts[r]["replica"] == 0:
            for k, v in parts[r]["model"].items():
                flat.setdefault(f"model.{names[k]}", v)
    for key, state in optim.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                flat.setdefault(f"optim.{names[key]}.{k}", v)
    scheduler = next((p["scheduler"] for p in parts.values() if p["scheduler"]), None)
    if scheduler:
        flat["scheduler"] = json.dumps(scheduler)
    scaler = next((p["scaler"] for p in parts.values() if p.get("scaler")), None)
    if scaler:
        flat["scaler"] = json.dumps(scaler)
    step = int(first["step"])
    samples = int(first["data_position"]) * batch * replicas
    flat["train"] = json.dumps({"step": step, "samples": samples, "history": first["history"]})
    rng: dict[str, str] = {}
    for r, part in parts.items():
        flat[f"rng.{r}.torch"] = part["rng"]["torch"]
        flat[f"rng.{r}.python"] = json.dumps(part["rng"]["python"])
        if "cuda" in part["rng"]:
            flat[f"rng.{r}.cuda"] = part["rng"]["cuda"]
        if "numpy" in part["rng"]:  # already JSON text (Note [numpy's stream in a checkpoint])
            flat[f"rng.{r}.numpy"] = part["rng"]["numpy"]
        stages = list(part["stages"])
        if len(stages) == 1:  # which schedule ordered several stages' draws is not recorded
            device = "cuda" if "cuda" in part["rng"] else "cpu"
            rng[str(r)] = rng_key(
                stages, manifest, (part["replica"], replicas), (0, 1), microbatches, None, device
            )
    token = new_token()
    new.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(new, token)
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled": one process, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(
                flat, storage_writer=dcp.FileSystemWriter(staging, sync_files=True), no_dist=True
            )
        files = {f.name: file_digest(f) for f in sorted(staging.iterdir())}
        commit_dcp(
            new,
            staging,
            token,
            files,
            {
                **meta,
                "step": step,
                "build": meta.get("build") or identity,
                "samples": samples,
                "layout": {
                    "num_stages": manifest.num_stages,
                    "stage_ranks": list(manifest.stage_ranks),
                    "world_size": world,
                    "replicas": replicas,
                    "schedule": manifest.schedule or "unknown",
                    "shard": "unknown",
                },
                "aliases": {k: v for k, v in sorted(names.items()) if k != v},
                "rng": rng,
                "converted_from": str(old),
            },
        )
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return (
        f"the model-keyed checkpoint after step {step} ({len(keys)} tensors, the optimizer "
        f"state of {len(optim)} parameters, {world} ranks' RNG streams); resume any layout of "
        f"the model with `fxpipe run NEW_BUILD --resume-from {new}`"
    )
