"""``CostModel``: link speed, optimizer state and device speeds, plus ``parse_size``.

The numbers here turn a profile's per-unit measurements into stage times and stage
memory (see ``fxpipe.partitioner.problem`` for the formulas, Note [stage cost]).

Note [hook pricing]: the data-parallel gradient all-reduce is priced by what torch's DDP
communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``) really send, in the
steady state (PowerSGD's first ``start_powerSGD_iter`` plain all-reduce steps are ignored).

* DDP groups the gradients into buckets of ``dp_bucket_bytes`` (``bucket_cap_mb``), filled
  in reverse parameter order, a bucket closing once it reaches the cap (``ddp_buckets``).
  Each all-reduce costs ``2(R-1)/R x bytes / link_bandwidth + 2(R-1) x link_latency``:
  a ring all-reduce is R-1 reduce-scatter hops then R-1 all-gather hops, each a message
  that pays the link's latency (Note [ring hops]).
* ``allreduce``: the gradients, one all-reduce per bucket. ``fp16``/``bf16``: half the
  bytes of the fp32 gradients.
* ``powersgd`` (``powerSGD_hook``), per parameter: its gradient viewed as the matrix
  ``shape[0] x rest`` (n x m) with rank ``r = min(n, m, powersgd_rank)`` is compressed when
  ``(n + m) r x POWERSGD_MIN_COMPRESSION_RATE < n m`` and then sends P (n x r) and Q (m x r):
  ``(n + m) r`` elements; every other tensor (1-D biases and norms, small matrices) is
  all-reduced uncompressed at its full size. Per bucket it issues three all-reduces: the
  uncompressed tensors, then P, then Q. A profile without shapes (older profiles) falls back
  to pricing each parameter as a square fp32 matrix, the same compression test applied.
* ``batched_powersgd`` (``batched_powerSGD_hook``): each bucket's flat gradient, zero-padded
  to a square of side ``ceil(sqrt(numel))``, always compressed: ``2 x side x r`` fp32
  numbers in two all-reduces (P, Q) per bucket.

Note [sharding pricing]: ``shard`` spreads a stage's training state over its R
data-parallel replicas (``fxpipe.runtime.dataparallel``, Note [sharding in a pipeline]).
Per step, with M microbatches and P the stage's parameter bytes (fp32; each parameter's
first dimension padded to a multiple of R, as FSDP2 pads its shards):

==========  =====================================  ==================================
level       collectives per step                   memory per rank (params, grads, optimizer state)
==========  =====================================  ==================================
none        all-reduce of the gradients (DDP)      P, P, f P
optimizer   all-reduce, then ZeRO's broadcast of   P, P, f P / R
            the updated parameters (P)
grad-op     1 all-gather (P), reduce-scatter (P)   P/R + P (gathered through the step), G, f P / R
full        2M all-gathers, reduce-scatter         P/R, G, f P / R
==========  =====================================  ==================================

The reduce-scatter runs once per step (``shard_reduce="step"``; the gradients of the
step accumulate unsharded: G = P) or once per microbatch (``"microbatch"``: M times,
G = P/R). ``shard_param_dtype`` scales the all-gathers and the gathered copy by its
size over fp32's, ``shard_reduce_dtype`` (default: the parameter dtype) the
reduce-scatters. Each collective of N bytes (the gathered result, the scattered input,
the broadcast tensor) sends ``(R-1)/R x N`` per rank on a ring, an all-reduce twice
that (``DataParallelTraffic.wire_bytes``); each pays the latency once per ring hop (Note
[ring hops]), as if the stage were one FSDP unit. A unit's transient whole parameters and
gradients (one or two units at a time) are not in the memory figures.

Note [ring hops]: a ring collective over R ranks is a sequence of R-1 steps in which
every rank sends one chunk to its neighbour and waits for one, so the link latency (the
alpha of alpha-beta) is paid once per step, not once per collective: a reduce-scatter,
an all-gather or a (pipelined) broadcast takes R-1 hops, an all-reduce 2(R-1)
(``ring_hops``).

Note [cluster links]: on a cluster of nodes of ``node_size`` devices, replica k's pipeline
rank r is device ``k x num_ranks + r`` (``fxpipe.partitioner.cluster``), so a pipeline's
neighbours share a node wherever the depth allows. A message between two pipeline ranks
that any replica places on two nodes is priced on the inter-node link (``crosses_nodes``,
``p2p_ms``: the slowest replica sets the step), as are the data-parallel collectives once
the ``num_ranks x dp_replicas`` devices span nodes (``dp_link``); everything else uses the
link. ``node_size`` 0 puts every device on one node.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fxpipe.calibration_data import names, values
from fxpipe.errors import ConfigError, PartitionError
from fxpipe.optionspec import check_options, option
from fxpipe.schema import read_dataclass
from fxpipe.sizes import format_size  # re-exported: the partitioner's reports import it from here

__all__ = [
    "CostModel",
    "AllReduceTraffic",
    "DataParallelTraffic",
    "LINK_PRESETS",
    "OPTIMIZER_STATE_FACTOR",
    "DEFAULT_LINKS",
    "default_link",
    "COMM_HOOKS",
    "SHARD_LEVELS",
    "SHARD_REDUCE",
    "SHARD_DTYPES",
    "PRECISIONS",
    "POWERSGD_MIN_COMPRESSION_RATE",
    "DEFAULT_BUCKET_BYTES",
    "ddp_buckets",
    "parse_size",
    "format_size",
    "ring_hops",
]


def _link(name: str) -> tuple[float, float]:
    link = values("links", name)
    return link["bandwidth"], link["latency"]


# (bandwidth in bytes/s, latency in seconds per message), one direction: nvlink, pcie,
# infiniband, ethernet and loopback (gloo between processes of one host), from
# calibration.json (Note [calibration data] in fxpipe.calibration_data).
LINK_PRESETS: dict[str, tuple[float, float]] = {name: _link(name) for name in names("links")}

# The link a plan assumes when none is named: what connects the devices of the trace's kind.
DEFAULT_LINKS: dict[str, str] = {"cuda": "nvlink", "cpu": "loopback"}


def default_link(trace_device: str) -> str:
    """The link preset assumed for a profile traced on ``trace_device`` (NVLink-class on CUDA, loopback on CPU)."""
    return DEFAULT_LINKS.get(trace_device, "loopback")


# Optimizer state kept per parameter byte (SGD none, momentum one buffer, Adam two moments).
OPTIMIZER_STATE_FACTOR: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}

# Data-parallel gradient communication hooks (fxpipe.runtime.dataparallel) the cost model can price.
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd")

# Sharding levels over the data-parallel replicas (Note [sharding pricing]), as fxpipe.runtime.dataparallel names them,
# when the sharded levels reduce-scatter their gradients, and the dtypes they may gather and reduce in.
SHARD_LEVELS = ("none", "optimizer", "grad-op", "full")
SHARD_REDUCE = ("step", "microbatch")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHARD_DTYPES = tuple(_DTYPE_BYTES)
# --precision: the runtime sends boundary tensors in the autocast dtype (fxpipe.runtime.pipeline.precision)
_WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PRECISIONS = tuple(_WIRE_BYTES)

# All-reduces each hook issues per DDP bucket (Note [hook pricing]).
_ALLREDUCES_PER_BUCKET = {
    "allreduce": 1,
    "fp16": 1,
    "bf16": 1,
    "powersgd": 3,
    "batched_powersgd": 2,
}

# PowerSGDState's default ``min_compression_rate``, which fxpipe's runtime keeps.
POWERSGD_MIN_COMPRESSION_RATE = 2

# DDP's bucket size for fxpipe's default ``bucket_cap_mb=25`` (MiB, as DDP reads it).
DEFAULT_BUCKET_BYTES = 25 * 2**20

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Bytes in a size such as ``"512MiB"``, ``"16GiB"``, ``"1KiB"``, ``"1.5GB"`` or ``4096``.

    Binary suffixes (KiB, MiB, GiB, TiB and bare K/M/G/T) are powers of 1024, decimal
    ones (kB, MB, GB, TB) powers of 1000.

    >>> parse_size("1.5GB"), parse_size("512MiB")
    (1500000000, 536870912)
    """
    if isinstance(text, bool):
        raise ConfigError(f"size {text!r} is not a number of bytes; use e.g. '16GiB'")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(
                f"cannot read size {text!r}; expected a number with an optional unit "
                "B, KiB, MiB, GiB, TiB, kB, MB, GB or TB, e.g. '512MiB' or '1.5GB'"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = value * _SIZE_UNITS[unit]
    if not math.isfinite(size):
        raise ConfigError(f"size {text!r} is not a finite number of bytes; use e.g. '16GiB'")
    if size <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return int(round(size))


def ring_hops(kind: str, replicas: int) -> int:
    """Latency-paying steps of one ring collective over ``replicas`` ranks (Note [ring hops]):
    ``"all_reduce"`` 2(R-1); ``"all_gather"``, ``"reduce_scatter"``, ``"broadcast"`` R-1.

    >>> ring_hops("all_reduce", 4), ring_hops("reduce_scatter", 4), ring_hops("all_gather", 1)
    (6, 3, 0)
    """
    if kind not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        raise ValueError(f"unknown collective {kind!r}")
    steps = max(replicas - 1, 0)
    return 2 * steps if kind == "all_reduce" else steps


@dataclass(frozen=True)
class AllReduceTraffic:
    """What one replica hands to the data-parallel all-reduces per step: ``wire_bytes`` in
    ``allreduces`` calls (the ring moves ``2(R-1)/R`` of the bytes over the link)."""

    wire_bytes: float
    allreduces: int


@dataclass(frozen=True)
class DataParallelTraffic:
    """What one replica of a stage hands to its data-parallel collectives per step (Note
    [sharding pricing]): bytes per kind (the gathered result of an all-gather, the input of
    a reduce-scatter or all-reduce, the broadcast tensor) and the number of collectives."""

    all_reduce_bytes: float = 0.0
    all_gather_bytes: float = 0.0
    reduce_scatter_bytes: float = 0.0
    broadcast_bytes: float = 0.0
    collectives: int = 0

    def wire_bytes(self, replicas: int) -> float:
        """Bytes one rank sends on a ring of ``replicas``: ``(R-1)/R`` of each collective, twice for all-reduces."""
        if replicas <= 1:
            return 0.0
        share = (replicas - 1) / replicas
        return share * (
            2 * self.all_reduce_bytes
            + self.all_gather_bytes
            + self.reduce_scatter_bytes
            + self.broadcast_bytes
        )


def ddp_buckets(param_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``param_bytes`` per DDP gradient bucket: reverse parameter order, a bucket
    closing once it holds ``bucket_bytes`` (DDP's ``compute_bucket_assignment_by_size``).

    >>> ddp_buckets([4, 4, 4], 8)
    [[2, 1], [0]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(param_bytes))):
        current.append(i)
        filled += param_bytes[i]
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def _powersgd_bytes(param_bytes: int, shape: Sequence[int] | None, rank: int) -> float:
    """Bytes ``powerSGD_hook`` sends for one gradient: P and Q when it compresses the
    ``shape[0] x rest`` matrix, else the whole tensor. Without a shape the parameter is
    taken as a square fp32 matrix (older profiles carry no shapes)."""
    if shape is None:
        numel = param_bytes / 4
        rows = cols = math.sqrt(numel)
    elif len(shape) == 0:
        return float(param_bytes)  # a 0-d tensor has no matrix view
    else:
        numel = math.prod(shape)
        if numel == 0:
            return 0.0
        rows, cols = shape[0], numel // shape[0]
    r = min(rows, cols, rank)
    compressed = (rows + cols) * r
    if compressed * POWERSGD_MIN_COMPRESSION_RATE < rows * cols:
        return compressed * param_bytes / numel
    return float(param_bytes)


def _batched_powersgd_bytes(bucket_bytes: int, rank: int) -> float:
    """Bytes ``batched_powerSGD_hook`` sends for one bucket of fp32 gradients: P and Q of its
    zero-padded square view, compressed whatever the saving."""
    side = math.ceil(math.sqrt(bucket_bytes / 4))
    return 2.0 * side * rank * 4


# The checks of the data-parallel options declared below: each returns the error line for a bad value (Note
# [options declared once]), so CostModel (fxpipe plan) and DataParallelOptions (fxpipe run, the seed API) say
# the same thing.
def _check_comm_hook(value: Any) -> str | None:
    if value in COMM_HOOKS:
        return None
    return (
        f"unknown comm_hook {value!r}; expected one of {list(COMM_HOOKS)} "
        "(or, in the seed API, register your own with register_comm_hook(state, hook))"
    )


def _check_powersgd_rank(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return f"powersgd_rank must be an int >= 1, got {value!r}; 1, 2 or 4 are usual"


def _check_choice(name: str, choices: tuple[str, ...]) -> Any:
    def check(value: Any) -> str | None:
        return (
            None
            if value in choices
            else f"unknown {name} {value!r}; expected one of {list(choices)}"
        )

    return check


def _check_dtype(name: str, none_means: str) -> Any:
    def check(value: Any) -> str | None:
        if value is None or value in SHARD_DTYPES:
            return None
        return f"{name} must be one of {list(SHARD_DTYPES)} (or None: {none_means}), got {value!r}"

    return check


@dataclass(frozen=True)
class CostModel:
    """How long messages take and how much memory training state needs.

    ``link_bandwidth`` is bytes/s and ``link_latency`` seconds per message, both per
    direction between neighbouring devices. ``device_speed[i]`` divides the compute time
    of stage i (2.0 = twice as fast as the profiled device); empty means all 1.0.
    ``optimizer`` picks the optimizer-state factor (sgd 0, momentum 1, adam 2 x params).
    ``dp_replicas`` copies of the pipeline average each stage's gradients once per step
    with a ring all-reduce over the same kind of link, compressed by ``comm_hook`` and
    grouped into DDP buckets of ``dp_bucket_bytes`` (``allreduce_ms``, Note [hook pricing]).

    >>> CostModel.preset("ethernet", optimizer="adam").link_bandwidth
    1250000000.0
    """

    link_bandwidth: float = LINK_PRESETS["loopback"][0]
    link_latency: float = LINK_PRESETS["loopback"][1]
    link: str = "loopback"
    optimizer: str = "sgd"
    device_speed: tuple[float, ...] = field(default=())
    dp_replicas: int = 1
    # The data-parallel options priced here are declared here, once (Note [options declared once] in
    # fxpipe.optionspec): fxpipe.runtime.dataparallel.DataParallelOptions and PlanOptions take them over.
    comm_hook: str = option(
        "allreduce",
        choices=COMM_HOOKS,
        parse_choices=False,
        metavar="HOOK",
        check=_check_comm_hook,
        help=f"DDP communication hook of the gradient all-reduce: {', '.join(COMM_HOOKS)}",
    )
    powersgd_rank: int = option(
        1,
        metavar="K",
        check=_check_powersgd_rank,
        help="PowerSGD matrix approximation rank (with --comm-hook powersgd/batched_powersgd)",
    )
    dp_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    shard: str = option(
        "none",
        choices=SHARD_LEVELS,
        metavar="LEVEL",
        check=_check_choice("shard level", SHARD_LEVELS),
        help="shard training state over the data-parallel replicas: none, optimizer (ZeRO-1: "
        "ZeroRedundancyOptimizer), grad-op (gradients too: FSDP2, ZeRO-2), full (parameters too: "
        "FSDP2, ZeRO-3); the plan prices each rank's memory and traffic",
    )
    shard_reduce: str = option(
        "step",
        choices=SHARD_REDUCE,
        metavar="WHEN",
        check=_check_choice("shard_reduce", SHARD_REDUCE),
        help="with --shard grad-op/full: reduce-scatter the gradients once per step or after "
        "every microbatch (gradients kept sharded, M times the traffic)",
    )
    shard_param_dtype: str | None = option(
        None,
        choices=SHARD_DTYPES,
        metavar="DTYPE",
        none_means="the parameters'",
        check=_check_dtype("shard_param_dtype", "the parameters' own"),
        help="with --shard grad-op/full: gather and compute in this dtype "
        "(FSDP2's MixedPrecisionPolicy)",
    )
    shard_reduce_dtype: str | None = option(
        None,
        choices=SHARD_DTYPES,
        metavar="DTYPE",
        none_means="--shard-param-dtype's",
        check=_check_dtype("shard_reduce_dtype", "shard_param_dtype's"),
        help="with --shard grad-op/full: reduce-scatter the gradients in this dtype",
    )
    node_size: int = 0  # devices per node; 0: all on one node (Note [cluster links])
    inter_link_bandwidth: float | None = None  # between nodes; None: the link above
    inter_link_latency: float | None = None
    recompute: tuple[bool, ...] = field(
        default=()
    )  # per stage: recompute activations in backward; (): none
    precision: str = option(
        "fp32",
        choices=PRECISIONS,
        metavar="P",  # fp32 boundary tensors travel in it (wire_bytes)
        help="autocast precision of each stage's forward and the loss: %(choices)s; boundary "
        "tensors travel in it (bf16/fp16: half the bytes)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "device_speed",
            tuple(_number("device_speed factor", s) for s in self.device_speed),
        )
        if not _number("link_bandwidth", self.link_bandwidth) > 0:
            raise ConfigError(f"link_bandwidth must be > 0 bytes/s, got {self.link_bandwidth}")
        if not _number("link_latency", self.link_latency) >= 0:
            raise ConfigError(f"link_latency must be >= 0 s, got {self.link_latency}")
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise ConfigError(
                f"unknown optimizer {self.optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_FACTOR)}"
            )
        if any(s <= 0 for s in self.device_speed):
            raise ConfigError(f"device_speed factors must be > 0, got {self.device_speed}")
        if not isinstance(self.dp_replicas, int) or self.dp_replicas < 1:
            raise ConfigError(
                f"dp_replicas must be an int >= 1, got {self.dp_replicas!r}; use 1 for no data parallelism"
            )
        check_options(self)  # comm_hook, powersgd_rank, shard, ...: their declared checks
        if not isinstance(self.dp_bucket_bytes, int) or self.dp_bucket_bytes < 1:
            raise ConfigError(
                f"dp_bucket_bytes must be an int >= 1, got {self.dp_bucket_bytes!r}; "
                f"DDP's default bucket_cap_mb=25 is {DEFAULT_BUCKET_BYTES}"
            )
        object.__setattr__(self, "recompute", tuple(self.recompute))
        if not all(isinstance(r, bool) for r in self.recompute):
            raise ConfigError(
                f"recompute must list one true/false per stage, got {self.recompute!r}"
            )
        if (
            not isinstance(self.node_size, int)
            or isinstance(self.node_size, bool)
            or self.node_size < 0
        ):
            raise ConfigError(
                f"node_size must be an int >= 0 (0: one node), got {self.node_size!r}"
            )
        if (
            self.inter_link_bandwidth is not None
            and not _number("inter_link_bandwidth", self.inter_link_bandwidth) > 0
        ):
            raise ConfigError(
                f"inter_link_bandwidth must be > 0 bytes/s, got {self.inter_link_bandwidth}"
            )
        if (
            self.inter_link_latency is not None
            and not _number("inter_link_latency", self.inter_link_latency) >= 0
        ):
            raise ConfigError(f"inter_link_latency must be >= 0 s, got {self.inter_link_latency}")
        if self.precision not in _WIRE_BYTES:
            raise ConfigError(
                f"precision must be one of {list(_WIRE_BYTES)}, got {self.precision!r}"
            )

    @classmethod
    def preset(cls, link: str, **overrides: Any) -> CostModel:
        """A cost model with the bandwidth and latency of a named link (see ``LINK_PRESETS``)."""
        if link not in LINK_PRESETS:
            raise ConfigError(
                f"unknown link preset {link!r}; expected one of {sorted(LINK_PRESETS)}"
            )
        bandwidth, latency = LINK_PRESETS[link]
        return cls(
            **{"link_bandwidth": bandwidth, "link_latency": latency, "link": link, **overrides}
        )

    @property
    def optimizer_factor(self) -> int:
        return OPTIMIZER_STATE_FACTOR[self.optimizer]

    def wire_bytes(self, nbytes: int) -> int:
        """The bytes of a boundary tensor of ``nbytes`` (fp32 in the profile) as sent between stages:
        half under bf16/fp16 autocast (priced as if every boundary tensor is floating point)."""
        return nbytes * _WIRE_BYTES[self.precision] // 4

    def message_ms(self, nbytes: float) -> float:
        """Time to move one tensor of ``nbytes`` over one link, in milliseconds."""
        return (nbytes / self.link_bandwidth + self.link_latency) * 1e3

    def _inter(self) -> tuple[float, float]:
        return (
            self.link_bandwidth if self.inter_link_bandwidth is None else self.inter_link_bandwidth,
            self.link_latency if self.inter_link_latency is None else self.inter_link_latency,
        )

    def crosses_nodes(self, rank_a: int, rank_b: int, num_ranks: int) -> bool:
        """Whether pipeline ranks ``rank_a`` and ``rank_b`` sit on different nodes in some
        replica (Note [cluster links]: replica k's rank r is device ``k x num_ranks + r``)."""
        n = self.node_size
        if n <= 0:
            return False
        period = n // math.gcd(num_ranks, n)  # k x num_ranks mod n repeats with this period
        return any(
            (k * num_ranks + rank_a) // n != (k * num_ranks + rank_b) // n
            for k in range(min(self.dp_replicas, period))
        )

    def p2p_ms(self, nbytes: float, rank_a: int, rank_b: int, num_ranks: int) -> float:
        """One message of ``nbytes`` between pipeline ranks, in ms: on the inter-node link when
        they sit on different nodes (``crosses_nodes``), else on the link."""
        if not self.crosses_nodes(rank_a, rank_b, num_ranks):
            return self.message_ms(nbytes)
        bandwidth, latency = self._inter()
        return (nbytes / bandwidth + latency) * 1e3

    def dp_link(self, num_ranks: int | None = None) -> tuple[float, float]:
        """(bandwidth, latency) of the data-parallel collectives of a pipeline of ``num_ranks``:
        the inter-node link when the ``num_ranks x dp_replicas`` devices span nodes."""
        if num_ranks is not None and 0 < self.node_size < num_ranks * self.dp_replicas:
            return self._inter()
        return self.link_bandwidth, self.link_latency

    def recomputes(self, num_stages: int) -> tuple[bool, ...]:
        """Per stage, whether it recomputes its activations in backward, checked against the stage count."""
        if not self.recompute:
            return (False,) * num_stages
        if len(self.recompute) != num_stages:
            raise PartitionError(
                f"recompute lists {len(self.recompute)} stages but there are {num_stages}; "
                "give one flag per stage or none"
            )
        return self.recompute

    def gradient_bytes(self, param_bytes: int, shape: Sequence[int] | None = None) -> float:
        """Bytes one parameter's fp32 gradient hands to the all-reduce under ``comm_hook``
        (Note [hook pricing]); ``shape`` is the parameter's shape when the profile has it."""
        if self.comm_hook in ("fp16", "bf16"):
            return param_bytes / 2
        if self.comm_hook == "powersgd":
            return _powersgd_bytes(param_bytes, shape, self.powersgd_rank)
        if self.comm_hook == "batched_powersgd":
            return _batched_powersgd_bytes(param_bytes, self.powersgd_rank)
        return float(param_bytes)

    def dp_traffic(
        self, param_bytes: Sequence[int], shapes: Sequence[Sequence[int] | None] | None = None
    ) -> AllReduceTraffic:
        """What one replica of a stage with these parameters sends per step (Note [hook pricing]).

        ``shapes[i]`` is the shape of parameter ``i`` (``None`` or no ``shapes``: unknown).
        """
        if shapes is not None and len(shapes) != len(param_bytes):
            raise PartitionError(
                f"{len(shapes)} parameter shapes given for {len(param_bytes)} parameters; "
                "give one shape (or None) per parameter"
            )
        key = None if shapes is None else tuple(None if sh is None else tuple(sh) for sh in shapes)
        return _dp_traffic(
            self.comm_hook, self.powersgd_rank, self.dp_bucket_bytes, tuple(param_bytes), key
        )

    def allreduce_ms(
        self,
        param_bytes: Sequence[int],
        shapes: Sequence[Sequence[int] | None] | None = None,
        num_ranks: int | None = None,
    ) -> float:
        """One step's data-parallel gradient all-reduce of parameters of these sizes, in ms.

        Ring all-reduce over ``dp_replicas``: ``2(R-1)/R x wire bytes / link_bandwidth +
        2(R-1) x link_latency`` per all-reduce the hook issues (``dp_traffic``, Note [ring
        hops]); zero without replicas or parameters.

        >>> CostModel(link_bandwidth=1e9, link_latency=0.0, dp_replicas=2).allreduce_ms([10**6])
        1.0
        """
        R = self.dp_replicas
        if R <= 1 or not param_bytes:
            return 0.0
        traffic = self.dp_traffic(param_bytes, shapes)
        bandwidth, latency = self.dp_link(num_ranks)
        hops = traffic.allreduces * ring_hops("all_reduce", R)
        return (2 * (R - 1) / R * traffic.wire_bytes / bandwidth + hops * latency) * 1e3

    # -- sharding (Note [sharding pricing]) ----------------------------------------

    @property
    def _sharded(self) -> bool:
        return self.dp_replicas > 1 and self.shard != "none"

    @property
    def ddp_synced(self) -> bool:
        """Whether replicas average their gradients through DDP: no sharding, or optimizer-state
        sharding's DDP hook (FSDP's levels reduce-scatter instead)."""
        return self.dp_replicas > 1 and self.shard in ("none", "optimizer")

    def _scale(self, dtype: str | None) -> float:
        return _DTYPE_BYTES[dtype] / 4 if dtype is not None else 1.0

    def state_shares(self) -> tuple[float, float, float]:
        """Bytes of (parameters, gradients, optimizer state) per rank per parameter byte."""
        f = float(self.optimizer_factor)
        if not self._sharded:
            return 1.0, 1.0, f
        R = self.dp_replicas
        if self.shard == "optimizer":
            return 1.0, 1.0, f / R
        grads = 1.0 if self.shard_reduce == "step" else 1.0 / R
        params = 1.0 / R + (self._scale(self.shard_param_dtype) if self.shard == "grad-op" else 0.0)
        return params, grads, f / R

    @property
    def optimizer_shards(self) -> int:
        """Over how many ranks each stage's optimizer step is divided (R when sharded, else 1)."""
        return self.dp_replicas if self._sharded else 1

    @property
    def state_factor(self) -> float:
        """Bytes of training state per rank per parameter byte (weights, gradients, optimizer state)."""
        params, grads, optimizer = self.state_shares()
        return params + grads + optimizer

    def stage_state_bytes(self, param_bytes: int) -> tuple[int, int, int]:
        """(parameters, gradients, optimizer state) bytes per rank of a stage with ``param_bytes``."""
        return tuple(int(round(share * param_bytes)) for share in self.state_shares())  # type: ignore[return-value]

    def _padded(
        self, param_bytes: Sequence[int], shapes: Sequence[Sequence[int] | None] | None
    ) -> float:
        """Bytes of the parameters with each first dimension padded to a multiple of R (FSDP2's shards)."""
        R, total = self.dp_replicas, 0.0
        for i, b in enumerate(param_bytes):
            shape = shapes[i] if shapes is not None else None
            if shape and shape[0] > 0:
                total += b * (math.ceil(shape[0] / R) * R) / shape[0]
            else:
                total += b
        return total

    def shard_traffic(
        self,
        param_bytes: Sequence[int],
        shapes: Sequence[Sequence[int] | None] | None = None,
        microbatches: int = 1,
    ) -> DataParallelTraffic:
        """What one replica of a stage sends per step at this sharding level (Note [sharding pricing])."""
        if self.dp_replicas <= 1 or not param_bytes:
            return DataParallelTraffic()
        if self.ddp_synced:
            ddp = self.dp_traffic(param_bytes, shapes)
        if self.shard == "none":
            return DataParallelTraffic(all_reduce_bytes=ddp.wire_bytes, collectives=ddp.allreduces)
        if self.shard == "optimizer":
            return DataParallelTraffic(
                all_reduce_bytes=ddp.wire_bytes,
                broadcast_bytes=float(sum(param_bytes)),
                collectives=ddp.allreduces + len(param_bytes),
            )
        M = microbatches
        gathers = 1 if self.shard == "grad-op" else 2 * M
        scatters = 1 if self.shard_reduce == "step" else M
        padded = self._padded(param_bytes, shapes)
        reduce_dtype = self.shard_reduce_dtype or self.shard_param_dtype
        return DataParallelTraffic(
            all_gather_bytes=gathers * padded * self._scale(self.shard_param_dtype),
            reduce_scatter_bytes=scatters * padded * self._scale(reduce_dtype),
            collectives=gathers + scatters,
        )

    def dp_comm_ms(
        self,
        param_bytes: Sequence[int],
        shapes: Sequence[Sequence[int] | None] | None = None,
        microbatches: int = 1,
        num_ranks: int | None = None,
    ) -> float:
        """One step's data-parallel communication of a stage, in ms: the all-reduce
        (``allreduce_ms``) without sharding, else the level's collectives on the dp link
        (``dp_link``: between nodes when a pipeline of ``num_ranks`` and its replicas span them)."""
        if not self._sharded:
            return self.allreduce_ms(param_bytes, shapes, num_ranks)
        traffic = self.shard_traffic(param_bytes, shapes, microbatches)
        bandwidth, latency = self.dp_link(num_ranks)
        return (
            traffic.wire_bytes(self.dp_replicas) / bandwidth
            + self._hops(param_bytes, shapes, traffic) * latency
        ) * 1e3

    def dp_hops(
        self,
        param_bytes: Sequence[int],
        shapes: Sequence[Sequence[int] | None] | None = None,
        microbatches: int = 1,
    ) -> int:
        """Ring hops of one step's data-parallel collectives of a stage (Note [ring hops]); 0 without replicas."""
        R = self.dp_replicas
        if R <= 1 or not param_bytes:
            return 0
        if not self._sharded:
            return self.dp_traffic(param_bytes, shapes).allreduces * ring_hops("all_reduce", R)
        return self._hops(
            param_bytes, shapes, self.shard_traffic(param_bytes, shapes, microbatches)
        )

    def _hops(
        self,
        param_bytes: Sequence[int],
        shapes: Sequence[Sequence[int] | None] | None,
        traffic: DataParallelTraffic,
    ) -> int:
        """Ring hops of a sharded step's collectives (Note [ring hops]): every collective R-1,
        the all-reduces of ``optimizer`` sharding (the DDP hook's) twice that."""
        R = self.dp_replicas
        all_reduces = (
            self.dp_traffic(param_bytes, shapes).allreduces if self.shard == "optimizer" else 0
        )
        return (traffic.collectives - all_reduces) * ring_hops(
            "broadcast", R
        ) + all_reduces * ring_hops("all_reduce", R)

    def speeds(self, num_stages: int) -> tuple[float, ...]:
        """Per-stage speed factors, checked against the stage count."""
        if not self.device_speed:
            return (1.0,) * num_stages
        if len(self.device_speed) != num_stages:
            raise PartitionError(
                f"device_speed lists {len(self.device_speed)} factors but there are {num_stages} stages; "
                "give one factor per stage or none"
            )
        return self.device_speed

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["device_speed"] = list(self.device_speed)
        d["recompute"] = list(self.recompute)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """A cost model from JSON data, every field checked (``ConfigError`` naming the field)."""
        return read_dataclass(cls, d, "cost model", ConfigError)


@functools.lru_cache(maxsize=4096)
def _dp_traffic(
    hook: str,
    rank: int,
    bucket_bytes: int,
    param_bytes: tuple[int, ...],
    shapes: tuple[tuple[int, ...] | None, ...] | None,
) -> AllReduceTraffic:
    """``CostModel.dp_traffic`` of one stage (cached: a search prices the same stage many times)."""
    buckets = ddp_buckets(param_bytes, bucket_bytes)
    if hook == "batched_powersgd":
        wire = sum(_batched_powersgd_bytes(sum(param_bytes[i] for i in b), rank) for b in buckets)
    elif hook in ("fp16", "bf16"):
        wire = sum(param_bytes) / 2
    elif hook == "powersgd":
        wire = sum(
            _powersgd_bytes(b, shapes[i] if shapes is not None else None, rank)
            for i, b in enumerate(param_bytes)
        )
    else:
        wire = float(sum(param_bytes))
    return AllReduceTraffic(wire_bytes=wire, allreduces=len(buckets) * _ALLREDUCES_PER_BUCKET[hook])


def _number(name: str, value: Any) -> float:
    """``value`` as a finite float, or a ``ConfigError`` naming ``name`` (NaN and infinities
    would become ``NaN``/``Infinity`` in plan.json and poison every comparison)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value}")
    return float(value)
