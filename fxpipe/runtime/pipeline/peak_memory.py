"""Peak tensor memory of one rank: live tensor storages on CPU, the caching allocator on CUDA.

Peak resident set size is no measure of a stage's tensors on CPU: ~300 MiB of it is the
torch runtime. ``TensorMemoryTracker`` counts instead the bytes of live tensor
*storages*, each storage once however many views share it: those it is given when it
starts (parameters, gradients, buffers, optimizer state, the step's data) and every
storage an aten op creates while it is active, each until it is freed (a
``weakref.finalize`` on the storage's Python object, which torch keeps alive exactly as
long as the storage). Ops are seen through a ``TorchDispatchMode``, which the autograd
engine carries into backward, so activations, gradients, receive buffers and
temporaries all count. Memory that kernels allocate for themselves (and never return as
a tensor) does not. Two things FSDP2 does (``--shard grad-op/full``) need care: a DTensor
is counted by its local shard's storage (its own ``untyped_storage()`` is a stand-in of
the shard's size, which counted every sharded parameter and gradient twice), and FSDP
frees and refills its gathered parameters by resizing their storage outside any op, so
once a DTensor is seen the tracker sums every storage's current size at each op. On CUDA ``torch.cuda.max_memory_allocated`` already counts this,
and ``peak_tensor_bytes`` uses it there.

The dispatch mode costs a Python call per aten op, so the worker measures one extra
step after the timed ones, never a timed step (``training_peak_tensor_bytes``).
``peak_memory_bytes`` is the coarser figure next to it: peak resident set size.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed support has no DTensor
    _DTensor = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from fxpipe.runtime.pipeline.runner import PipelineRunner

__all__ = [
    "TensorMemoryTracker",
    "peak_tensor_bytes",
    "state_tensors",
    "training_peak_tensor_bytes",
    "peak_memory_bytes",
]


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages while active (see the module docstring).

    >>> w = torch.zeros(256)                       # 1 KiB that exists before the tracker
    >>> with TensorMemoryTracker([w]) as tracker:
    ...     y = w + 1                              # +1 KiB
    ...     z = y.view(16, 16)                     # a view: no new storage
    ...     del y, z                               # freed
    ...     s = (w * 2).sum()                      # a 1 KiB temporary (freed), then 4 bytes
    >>> tracker.peak_bytes, tracker.live_bytes     # w + y, then w + the temporary + s
    (2052, 1028)
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # id of a live storage's Python object -> its bytes
        self._storages: dict[int, weakref.ref[Any]] = {}
        self._resized = False  # storages may be resized outside ops (FSDP2): re-sum at each op
        self._lock = threading.Lock()  # finalizers may run on another thread (autograd, GC)
        self.live_bytes = 0
        self.peak_bytes = 0
        for t in tensors:
            self.track(t)

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage until it is freed (once, however many views share it)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        local = _local_tensor(tensor)
        if local is not tensor:
            self._resized = True
            tensor = local
        storage = tensor.untyped_storage()
        key, nbytes = id(storage), storage.nbytes()
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                weakref.finalize(storage, self._free, key)
                self._sizes[key] = nbytes
                self._storages[key] = weakref.ref(storage)
                self.live_bytes += nbytes
            elif old != nbytes:  # resized in place (an ``out=`` op or ``resize_``)
                self._sizes[key] = nbytes
                self.live_bytes += nbytes - old
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._sizes.pop(key, 0)
            self._storages.pop(key, None)

    def _resum(self) -> None:
        """Every storage at its current size (FSDP2 resizes its gathered parameters outside any op)."""
        with self._lock:
            for key, ref in list(self._storages.items()):
                storage = ref()
                if storage is not None:
                    nbytes = storage.nbytes()
                    self.live_bytes += nbytes - self._sizes[key]
                    self._sizes[key] = nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._resized:  # a storage freed by a resize since the last op
            self._resum()
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        if self._resized:
            self._resum()
        return out


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage that holds its bytes, without an op: the tracker may be
    inside its own dispatch); any other tensor itself."""
    if _DTensor is None or not isinstance(tensor, _DTensor):
        return tensor
    return tensor._local_tensor


def state_tensors(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[torch.Tensor]:
    """The tensors a training step starts from: parameters, their gradients, buffers, optimizer state."""
    out = [t for t in module.parameters()] + [t for t in module.buffers()]
    out += [p.grad for p in module.parameters() if p.grad is not None]
    if optimizer is not None:
        out += [
            t
            for state in optimizer.state.values()
            for t in tree_leaves(state)
            if isinstance(t, torch.Tensor)
        ]
    return out


def peak_tensor_bytes(
    device: torch.device,
    fn: Callable[[], Any],
    tensors: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]] = (),
) -> int:
    """Peak bytes of tensors alive while ``fn()`` runs, ``tensors`` (alive at the start) included.

    CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``, reset first;
    it sees every tensor on the device, so ``tensors`` are counted whether listed or not).
    Elsewhere: a ``TensorMemoryTracker`` around ``fn``, which counts only ``tensors`` and
    what ``fn`` creates. Pass ``tensors`` as a function returning them when ``fn`` may free
    some of them (``zero_grad(set_to_none=True)`` frees the gradients): a list given
    directly stays referenced by this call and would keep them alive.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    tracker = _tracker(tensors)
    with tracker:
        fn()
    return tracker.peak_bytes


def _tracker(
    tensors: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
) -> TensorMemoryTracker:
    """A tracker counting ``tensors``, holding no reference to them once it returns."""
    tracker = TensorMemoryTracker()
    for t in tensors() if callable(tensors) else tensors:
        tracker.track(t)
    return tracker


def training_peak_tensor_bytes(
    runner: PipelineRunner, inputs: tuple[torch.Tensor, ...], targets: Any, steps: int
) -> int:
    """Peak tensor bytes of this rank over ``steps`` more training steps of ``runner`` (one
    accumulation window, after the timed ones, so the tracker's per-op cost never lands in a
    timed step): the stage's state, the step's data, the receive buffers the timed steps left
    in the pools and everything the steps create. The previous step's gradients count until
    the step frees them (no list of them is kept)."""

    def start() -> list[torch.Tensor]:
        data = [t for t in (*inputs, *tree_leaves(targets)) if isinstance(t, torch.Tensor)]
        return state_tensors(runner.stage, runner.optimizer) + data + runner.executor.comm.pooled()

    def run() -> None:
        for _ in range(steps):
            runner.step(inputs, targets)

    return peak_tensor_bytes(runner.device, run, start)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA peak allocated on a GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
