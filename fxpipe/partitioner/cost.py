"""``CostModel``: link speed, optimizer state and device speeds, plus ``parse_size``.

The numbers here turn a profile's per-unit measurements into stage times and stage
memory (see ``fxpipe.partitioner.problem`` for the formulas, Note [stage cost]).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fxpipe.errors import ConfigError, PartitionError

__all__ = ["CostModel", "LINK_PRESETS", "OPTIMIZER_STATE_FACTOR", "COMM_HOOKS", "parse_size", "format_size"]

# (bandwidth in bytes/s, latency in seconds per message), one direction.
LINK_PRESETS: dict[str, tuple[float, float]] = {
    "nvlink": (200e9, 10e-6),        # NVLink 3/4, effective point-to-point
    "pcie": (16e9, 20e-6),           # PCIe 4.0 x16 effective
    "infiniband": (25e9, 5e-6),      # HDR 200 Gb/s
    "ethernet": (1.25e9, 50e-6),     # 10 Gb/s
    "loopback": (4.4e9, 100e-6),     # gloo, 2 processes on this machine (NOTES-tracing.md)
}

# Optimizer state kept per parameter byte (SGD none, momentum one buffer, Adam two moments).
OPTIMIZER_STATE_FACTOR: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2}

# Data-parallel gradient communication hooks (fxpipe.runtime.dataparallel) the cost model can price.
COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "batched_powersgd")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
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
    if size <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return int(round(size))


def format_size(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: binary units, three significant digits."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class CostModel:
    """How long messages take and how much memory training state needs.

    ``link_bandwidth`` is bytes/s and ``link_latency`` seconds per message, both per
    direction between neighbouring devices. ``device_speed[i]`` divides the compute time
    of stage i (2.0 = twice as fast as the profiled device); empty means all 1.0.
    ``optimizer`` picks the optimizer-state factor (sgd 0, momentum 1, adam 2 x params).
    ``dp_replicas`` copies of the pipeline average each stage's gradients once per step
    with a ring all-reduce over the same kind of link, compressed by ``comm_hook``
    (``allreduce_ms``).

    >>> CostModel.preset("ethernet", optimizer="adam").link_bandwidth
    1250000000.0
    """

    link_bandwidth: float = LINK_PRESETS["loopback"][0]
    link_latency: float = LINK_PRESETS["loopback"][1]
    link: str = "loopback"
    optimizer: str = "sgd"
    device_speed: tuple[float, ...] = field(default=())
    dp_replicas: int = 1
    comm_hook: str = "allreduce"
    powersgd_rank: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_speed", tuple(float(s) for s in self.device_speed))
        if self.link_bandwidth <= 0:
            raise ConfigError(f"link_bandwidth must be > 0 bytes/s, got {self.link_bandwidth}")
        if self.link_latency < 0:
            raise ConfigError(f"link_latency must be >= 0 s, got {self.link_latency}")
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise ConfigError(
                f"unknown optimizer {self.optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_FACTOR)}"
            )
        if any(s <= 0 for s in self.device_speed):
            raise ConfigError(f"device_speed factors must be > 0, got {self.device_speed}")
        if not isinstance(self.dp_replicas, int) or self.dp_replicas < 1:
            raise ConfigError(f"dp_replicas must be an int >= 1, got {self.dp_replicas!r}; use 1 for no data parallelism")
        if self.comm_hook not in COMM_HOOKS:
            raise ConfigError(f"unknown comm_hook {self.comm_hook!r}; expected one of {list(COMM_HOOKS)}")
        if not isinstance(self.powersgd_rank, int) or self.powersgd_rank < 1:
            raise ConfigError(f"powersgd_rank must be an int >= 1, got {self.powersgd_rank!r}")

    @classmethod
    def preset(cls, link: str, **overrides: Any) -> CostModel:
        """A cost model with the bandwidth and latency of a named link (see ``LINK_PRESETS``)."""
        if link not in LINK_PRESETS:
            raise ConfigError(f"unknown link preset {link!r}; expected one of {sorted(LINK_PRESETS)}")
        bandwidth, latency = LINK_PRESETS[link]
        return cls(**{"link_bandwidth": bandwidth, "link_latency": latency, "link": link, **overrides})

    @property
    def optimizer_factor(self) -> int:
        return OPTIMIZER_STATE_FACTOR[self.optimizer]

    def message_ms(self, nbytes: float) -> float:
        """Time to move one tensor of ``nbytes`` over one link, in milliseconds."""
        return (nbytes / self.link_bandwidth + self.link_latency) * 1e3

    def gradient_bytes(self, param_bytes: int) -> float:
        """Bytes one parameter's fp32 gradient puts on the wire under ``comm_hook``.

        fp16/bf16 halve it. PowerSGD sends ``(rows + cols) x rank`` numbers instead of
        ``rows x cols``; the profile has parameter sizes but not shapes, so a parameter is
        priced as a square matrix, and left uncompressed (as PowerSGD does) unless that
        at least halves it.
        """
        if self.comm_hook in ("fp16", "bf16"):
            return param_bytes / 2
        if self.comm_hook in ("powersgd", "batched_powersgd"):
            side = math.sqrt(param_bytes / 4)
            compressed = 2 * side * self.powersgd_rank * 4
            return compressed if 2 * compressed <= param_bytes else float(param_bytes)
        return float(param_bytes)

    def allreduce_ms(self, param_bytes: Sequence[int]) -> float:
        """One step's data-parallel gradient all-reduce of parameters of these sizes, in ms.

        Ring all-reduce over ``dp_replicas``: ``2(R-1)/R x bytes / link_bandwidth +
        link_latency``; zero without replicas or parameters.

        >>> CostModel(link_bandwidth=1e9, link_latency=0.0, dp_replicas=2).allreduce_ms([10**6])
        1.0
        """
        R = self.dp_replicas
        if R <= 1 or not param_bytes:
            return 0.0
        wire = sum(self.gradient_bytes(b) for b in param_bytes)
        return (2 * (R - 1) / R * wire / self.link_bandwidth + self.link_latency) * 1e3

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
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        known = set(cls.__dataclass_fields__)
        kwargs: dict[str, Any] = {k: (tuple(v) if k == "device_speed" else v) for k, v in d.items() if k in known}
        return cls(**kwargs)
