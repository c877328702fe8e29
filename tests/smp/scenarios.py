"""Rank functions for the spawned jobs of the seed-API tests (importable by spawned children).

Each job runs several trainings one after another in the same processes
(``shutdown(destroy_process_group=False)`` between them) to keep the number of
spawned jobs small.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

import fxpipe.smp as api
from fxpipe.errors import ConfigError
from seedscripts import load_script


def _quiet() -> None:
    warnings.filterwarnings("ignore", message="trace_device='gpu'")


def _errors_before_partition() -> dict[str, str]:
    """What a user gets when calling the model wrongly; all must be FxpipeErrors with a remedy."""
    out = {}
    model = api.DistributedModel(torch.nn.Linear(4, 2))
    for name, call in [
        ("forward", lambda: model(torch.zeros(2, 4))),
        ("backward", lambda: model.backward(torch.zeros(()))),
        ("local", lambda: model.local_state_dict()),
    ]:
        try:
            call()
            out[name] = "no error"
        except api.StepError as exc:
            out[name] = str(exc)
    return out


def training_job(rank: int, world: int, plan_dir: str) -> dict[str, Any]:
    _quiet()
    out: dict[str, Any] = {}
    try:
        api.init({"partitions": 3})
        out["world_error"] = "no error"
    except ConfigError as exc:
        out["world_error"] = str(exc)
    api.init({"partitions": 2, "microbatches": 4})
    out["errors"] = _errors_before_partition()
    api.shutdown(destroy_process_group=False)

    script = load_script("train_loop")
    out["sgd"] = script.main({"partitions": 2, "microbatches": 4, "pipeline": "interleaved"}, "sgd")
    api.shutdown(destroy_process_group=False)
    out["zb-h1"] = script.main({"partitions": 2, "microbatches": 4, "pipeline": "zb-h1"}, "sgd")
    out["ranks"] = {
        "rank": api.rank(),
        "size": api.size(),
        "local_rank": api.local_rank(),
        "local_size": api.local_size(),
        "mp_rank": api.mp_rank(),
        "mp_size": api.mp_size(),
        "dp_rank": api.dp_rank(),
        "dp_size": api.dp_size(),
        "tracing": api.is_tracing(),
        "groups": all(
            g is not None
            for g in (
                api.get_world_process_group(),
                api.get_mp_process_group(),
                api.get_dp_process_group(),
            )
        ),
        "broadcast": api.broadcast({"from": api.rank()}, src=1),
    }
    api.barrier()
    api.shutdown(destroy_process_group=False)

    adam_cfg = {"partitions": 2, "microbatches": 2, "pipeline": "simple", "optimize": "memory"}
    out["adam"] = script.main(adam_cfg, "adam")
    out["adam_plan_optimize"] = api.state.current().model.plan.optimize
    api.shutdown(destroy_process_group=False)

    out["manual"] = load_script("manual_partition").main()
    api.shutdown(destroy_process_group=False)

    out["plan"] = _train_from_plan(plan_dir)
    api.shutdown(destroy_process_group=False)
    return out


def _step_function(source: Any) -> Any:
    """The model file's training step (forward, loss, backward) as a ``@step`` function."""

    @api.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = source.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    return train_step


def _train_from_plan(plan_dir: str) -> dict[str, Any]:
    """``plan=DIR``: stages from a build made ahead of time, weights from the wrapped model."""
    from fxpipe.modelfile import load_model_file

    source = load_model_file(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
    api.init({"partitions": 2, "microbatches": 2, "plan": plan_dir})
    torch.manual_seed(7)
    model = api.DistributedModel(source.build_model())
    opt = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    hook_calls: list[Any] = []
    handle = model.register_post_partition_hook(lambda m: hook_calls.append(m.partitioned))
    handle_removed = model.register_post_partition_hook(lambda m: hook_calls.append("removed"))
    handle_removed.remove()

    train_step = _step_function(source)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(
            train_step(model, source.example_inputs(8)[0], source.example_targets(8))
            .reduce_mean()
            .item()
        )
        opt.step()
    handle.remove()
    return {"losses": losses, "hook_calls": hook_calls, "state_dict": model.state_dict()}


def footprint_job(rank: int, world: int) -> dict[str, Any]:
    """A first-step build and training; what it leaves in the temp folder and on ``nn.Module``, as it goes."""
    import inspect
    import os
    import tempfile

    from fxpipe.modelfile import load_model_file

    def fxpipe_files() -> list[str]:
        return sorted(name for name in os.listdir(tempfile.gettempdir()) if "fxpipe" in name)

    def module_patched() -> bool:
        return (
            "__new__" in torch.nn.Module.__dict__
            or torch.nn.Module.__dict__["__init__"] is not original
        )

    original = torch.nn.Module.__dict__["__init__"]
    source = load_model_file(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
    api.init({"partitions": 2, "microbatches": 2})
    out: dict[str, Any] = {
        "patched_after_init": module_patched()
    }  # constructor arguments are being recorded
    model = api.DistributedModel(source.build_model())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = api.DistributedOptimizer(sgd)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    train_step = _step_function(source)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            train_step(model, source.example_inputs(8)[0], source.example_targets(8))
            opt.step()
            scheduler.step()
            lrs.append(opt.param_groups[0]["lr"])
    api.barrier()
    out.update(
        files_after_partitioning=fxpipe_files(),
        patched_after_partitioning=module_patched(),
        build_dir=model.build_dir,
        optimizer_methods=sorted(k for k in vars(opt) if callable(vars(opt)[k])),
        same_object=opt is sgd,
        optimizer_class=type(opt).__name__,
        lrs=lrs,
        stage_source=inspect.getsource(type(model.module)).splitlines()[0],  # for tracebacks
        scheduler_warnings=[str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
    )
    api.shutdown(destroy_process_group=False)
    opt.step()  # a plain torch optimizer again (through the scheduler's own wrapper of step)
    out.update(
        patched_after_shutdown=module_patched(),
        optimizer_methods_after_shutdown=sorted(k for k in vars(opt) if callable(vars(opt)[k])),
    )
    return out


def checkpoint_job(rank: int, world: int, directory: str) -> dict[str, Any]:
    _quiet()
    script = load_script("checkpoint")
    out = {"uninterrupted": script.run_and_save(directory)}
    api.shutdown(destroy_process_group=False)
    out["partial"] = script.resume(directory, partial=True)
    api.shutdown(destroy_process_group=False)
    out["full"] = script.resume(directory, partial=False)
    api.shutdown(destroy_process_group=False)
    out["scaler"] = load_script("grad_scaler").main(steps=3, inject_inf_at=1)["record"]
    api.shutdown(destroy_process_group=False)
    out["tied"] = tied_gpt_scenario()
    api.shutdown(destroy_process_group=False)
    return out


def tied_gpt_scenario() -> dict[str, Any]:
    """examples/gpt.py: a user-defined leaf (attention) and input/output embeddings tied across stages."""
    from fxpipe.modelfile import load_model_file

    source = load_model_file(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
    api.init({"partitions": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = source.build_model()  # built after init: leaf constructor arguments are recorded
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = api.DistributedModel(model)
    opt = api.DistributedOptimizer(opt)

    train_step = _step_function(source)
    x, y = source.example_inputs(4)[0], source.example_targets(4)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(train_step(model, x, y).reduce_mean().item())
        opt.step()
    return {"losses": losses, "ties": len(model.manifest.ties), "state_dict": model.state_dict()}
