"""Several stages (chunks) per process in the seed API: ``interleaved-1f1b`` and ``zbv``.

Note [chunked schedules in the seed API]: with one stage per process the ``@step``
function runs once per microbatch, one call after another, and each rank's actions can
follow the user's calls (Note [user-driven schedule] in ``fxpipe.smp.driver``). With
several chunks per rank they cannot: ZBV's rank 0 holds the first chunk and the loss
chunk, and runs ``F`` of the first chunk on microbatch 1 before ``F`` of the loss chunk on
microbatch 0, so it needs microbatch 1's inputs before microbatch 0's loss code has run.
So here each microbatch's call of the ``@step`` function runs in a thread of its own, and
the process's main thread walks the rank's action list (``ChunkedDriver.walk``), handing
control to one thread at a time: exactly one of them runs at any moment, so the user's
code never runs concurrently with itself or with the stages. A thread runs until its
``model(...)`` call, which records the inputs; on the rank of the loss chunk it waits
there until ``F`` of the loss chunk has run, then gets the real output and runs to its end
(computing the loss and requesting ``B`` with ``model.backward``); elsewhere
``model(...)`` returns placeholders at once and the call runs to its end. The
microbatches' calls start in microbatch order (call m+1 may start before call m ends)
and each runs under the step's grad mode, autocast and CUDA device; the stages' forwards
run under the grad mode and autocast of their ``model(...)`` call.

``RankChunks`` shows the rank's chunks as one module with the original model's keys
(the chunk's module trees merged; tied parameters on one rank are one ``nn.Parameter``),
so ``state_dict``, the optimizer and ``local_*`` see what a one-stage rank shows. With
``ddp: True`` it is also what DDP wraps (``fxpipe.smp.replicas``): one synchronising pass per
step over all the rank's chunks, after ``walk`` has run the step's last ``W``, averages the
gradients that ``B`` and ``W`` accumulated in ``.grad`` (Note [one all-reduce per step] in
``fxpipe.runtime.dataparallel.replica``). FSDP levels are refused there, as in the runtime.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import StepError
from fxpipe.partitioner.schedule import make_schedule, validate_schedule
from fxpipe.runtime.pipeline.comm import RankComm
from fxpipe.runtime.pipeline.p2p import P2P
from fxpipe.runtime.pipeline.routes import Routes
from fxpipe.runtime.pipeline.schedule import ActionKind
from fxpipe.runtime.pipeline.stage_io import StageWorker, assemble_output, microbatch_size
from fxpipe.smp.driver import check_backward_request, placeholder, user_grads

__all__ = ["RankChunks", "ChunkedDriver", "run_chunked_step"]

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


class RankChunks(nn.Module):
    """The stages of one rank as one module under the original model's keys (not callable: the
    ``DistributedModel`` runs the chunks). ``train``/``eval`` reach every chunk."""

    def __init__(self, chunks: Mapping[int, nn.Module]) -> None:
        super().__init__()
        self.chunks: dict[int, nn.Module] = dict(
            sorted(chunks.items())
        )  # a plain dict: merged below, not registered
        for chunk in self.chunks.values():
            _merge(self, chunk)

    def train(self, mode: bool = True) -> RankChunks:
        super().train(mode)
        for chunk in self.chunks.values():
            chunk.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise StepError(
            "this rank runs several stages; call the DistributedModel inside a @step function, "
            "not its module"
        )


def _merge(into: nn.Module, src: nn.Module) -> None:
    """Add ``src``'s parameters, buffers and submodules to ``into`` (a path both hold becomes a plain
    container of the union; the chunks' own modules are never changed)."""
    for name, p in src._parameters.items():
        if p is not None:
            into._parameters.setdefault(name, p)
    for name, b in src._buffers.items():
        if b is not None and name not in into._buffers:
            into._buffers[name] = b
            if name in src._non_persistent_buffers_set:
                into._non_persistent_buffers_set.add(name)
    for name, child in src._modules.items():
        if child is None:
            continue
        have = into._modules.get(name)
        if have is None:
            into._modules[name] = child
        elif have is not child:
            if not isinstance(have, _Union):
                union = _Union()
                _merge(union, have)
                into._modules[name] = have = union
            _merge(have, child)


class _Union(nn.Module):
    """A module path that several chunks hold (each with part of its children)."""


@dataclass
class _Call:
    """One microbatch's call of the ``@step`` function, in its own thread (see the Note)."""

    run: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    started: bool = False
    done: bool = False
    aborted: bool = False

    def __post_init__(self) -> None:
        self._go, self._paused = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._grad, self._autocast = torch.is_grad_enabled(), _autocast_state()
        # the current CUDA device is per thread too: the calls see the rank's, as the step does
        self._cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def _main(self) -> None:
        self._go.wait()
        self._go.clear()
        try:
            if self._cuda is not None:
                torch.cuda.set_device(self._cuda)
            with torch.set_grad_enabled(self._grad), _autocast(self._autocast):
                self.result = self.run()
        except BaseException as exc:  # raised in the main thread by resume()
            self.error = exc
        finally:
            self.done = True
            self._paused.set()

    def resume(self) -> None:
        """Run this call (from the main thread) until it pauses or ends; its error is raised here."""
        self._paused.clear()
        if not self.started:
            self.started = True
            self._thread.start()
        self._go.set()
        self._paused.wait()
        if self.error is not None and not isinstance(self.error, _Aborted):
            error, self.error = self.error, None
            raise error

    def pause(self) -> None:
        """Give control back to the main thread (from this call's thread) until resumed."""
        self._go.clear()
        self._paused.set()
        self._go.wait()
        if self.aborted:
            raise _Aborted()

    def abort(self) -> None:
        """End a paused call (its ``model(...)`` raises ``_Aborted``) and wait for its thread."""
        if self.started and not self.done:
            self.aborted = True
            self._paused.clear()
            self._go.set()
            self._paused.wait()


class _Aborted(BaseException):
    """Ends a microbatch's call when the step failed elsewhere."""


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    return [
        (d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)
    ]


class _autocast:
    """Enter the autocast regions of ``state`` (``_autocast_state``)."""

    def __init__(self, state: list[tuple[str, torch.dtype]]) -> None:
        self._modes = [torch.autocast(d, dtype=dtype) for d, dtype in state]

    def __enter__(self) -> None:
        for mode in self._modes:
            mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


@dataclass
class _Inputs:
    """What ``model(...)`` of one microbatch gave: the inputs, and the modes it was called under."""

    tensors: Sequence[torch.Tensor]
    mb_size: int
    grad: bool
    autocast: list[tuple[str, torch.dtype]]


class ChunkedDriver:
    """Runs the actions of this rank's chunks for one step (see the Note); one per step."""

    def __init__(
        self,
        manifest: Manifest,
        routes: Routes,
        rank: int,
        chunks: Mapping[int, nn.Module],
        p2p: P2P,
        device: torch.device,
        schedule: str,
        microbatches: int,
        average: bool,
        calls: Sequence[_Call],
    ) -> None:
        self.manifest, self.routes, self.device = manifest, routes, device
        self.calls = calls
        plan = make_schedule(schedule, manifest.num_ranks, microbatches, manifest.virtual_stages)
        validate_schedule(plan, routes.links())
        self.actions = plan.rank_actions(rank)
        self.split = plan.split_backward()
        self.microbatches = microbatches
        self.scale = 1.0 / microbatches if average else 1.0
        self.loss_stage = routes.loss_stage
        self.holds_loss = self.loss_stage in chunks
        self.comm = RankComm(p2p, device, False)
        self.workers = {
            s: StageWorker(
                manifest,
                routes,
                s,
                m,
                p2p,
                device,
                False,
                comm=self.comm,
                local_stages=tuple(chunks),
            )
            for s, m in chunks.items()
        }
        self._outputs = {o.name: o for s in manifest.stages for o in s.outputs}
        self.inputs: dict[int, _Inputs] = {}
        self.results: dict[int, Any] = {}  # loss rank: the model output of each microbatch
        self.user: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.requested: set[int] = set()
        self.backward_ran = False

    # -- the user's calls (in a microbatch's thread) -----------------------------

    def forward(self, m: int, inputs: Sequence[torch.Tensor]) -> Any:
        """Record ``model(...)`` of microbatch ``m``; its output (or placeholders off the loss rank)."""
        if m in self.inputs:
            raise StepError(
                f"the model was called twice in microbatch {m}; call it once per @step function call"
            )
        mb_size = microbatch_size(self.manifest, inputs)
        sizes = self.manifest.step_sizes([tuple(t.shape) for t in inputs])
        self.inputs[m] = _Inputs(inputs, mb_size, torch.is_grad_enabled(), _autocast_state())
        if not self.holds_loss:
            return assemble_output(
                self.manifest,
                [
                    placeholder(self.manifest, self._outputs[n], mb_size, self.device, sizes)
                    for n in self.routes.model_outputs
                ],
            )
        self.calls[m].pause()  # until F of the loss chunk has run (ChunkedDriver.walk)
        return self.results.pop(m)

    def backward(
        self, m: int, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
    ) -> None:
        """Request ``B(m)``; on the loss rank ``tensors``/``grads`` are what to backpropagate."""
        check_backward_request(m, m in self.inputs, self.requested)
        if self.holds_loss:
            self.user[m] = user_grads(tensors, grads, self.scale)
        self.requested.add(m)

    # -- the main thread ---------------------------------------------------------

    def walk(self, enter: Callable[[int], None]) -> None:
        """Run this rank's actions in order; ``enter(m)`` hands control to microbatch m's call."""
        started = 1  # call 0 ran up to its model(...): that made this driver
        for a in self.actions:
            m, worker = a.microbatch, self.workers[a.stage]
            if a.kind is F:
                while started <= m:
                    enter(started)
                    started += 1
                got = self.inputs.get(m)
                if got is None:
                    raise StepError(
                        f"microbatch {m} never called the model on pipeline rank "
                        f"{self.manifest.stage_ranks[a.stage]}; call model(...) exactly once in every "
                        "call of the @step function"
                    )
                # the step's dynamic sizes (Note [shape formulas]), checked before this action's messages
                worker.sizes = self.manifest.step_sizes([tuple(t.shape) for t in got.tensors])
                with torch.set_grad_enabled(got.grad), _autocast(got.autocast):
                    worker.forward(m, got.tensors, got.mb_size)
                if a.stage == self.loss_stage:
                    self.results[m] = assemble_output(self.manifest, worker.model_outputs(m))
                    enter(m)  # the user's loss code, up to the end of the call
            elif a.kind is B:
                if m not in self.requested:
                    worker.discard(m)  # forward only: no backward for this microbatch
                    continue
                tensors, grads = (
                    self.user.pop(m, ([], [])) if a.stage == self.loss_stage else ([], [])
                )
                worker.backward(m, tensors, grads, split=(a.stage, m) in self.split)
                self.backward_ran = True
            elif worker.has_pending_weight(m):
                worker.weight(m)

    def microbatch_done(self, m: int) -> None:
        """Nothing to record: ``walk`` itself sees each call end (``StepDriver``'s protocol)."""

    def finish(self) -> bool:
        """Wait for every send of the step; whether any backward ran."""
        self.comm.finish()
        return self.backward_ran


def run_chunked_step(
    model: Any, fn: Callable[..., Any], per_mb: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]
) -> list[Any]:
    """Run ``fn`` on every microbatch (``per_mb``: its arguments) with ``model``'s chunked schedule
    (see the Note); the calls' results in microbatch order. ``model`` is the ``DistributedModel``."""

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
        return lambda: fn(*args, **kwargs)

    calls = [_Call(bind(a, k)) for a, k in per_mb]
    model._calls = calls

    def enter(m: int) -> None:
        model._microbatch = m
        calls[m].resume()

    try:
        enter(0)  # up to its model(...): partitions at the first step, makes the step's driver
        driver = model._driver
        if driver is None:
            raise StepError(
                "microbatch 0 never called the model; call model(...) exactly once in every call of "
                "the @step function"
            )
        driver.walk(enter)
        for m, call in enumerate(calls):
            if not call.done:
                enter(m)
    finally:
        for call in calls:
            call.abort()
        model._calls = None
    return [call.result for call in calls]
