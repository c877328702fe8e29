"""``ClusterSpec``: how many devices, how much memory each, how they sit in nodes and how nodes connect.

The cluster search (``fxpipe.partitioner.search.configurations``) lays a configuration of S pipeline
ranks x R replicas out on it pipeline-first: replica k's rank r is device ``k x S + r``
(Note [cluster links] in ``fxpipe.partitioner.cost``), so a pipeline's neighbours are
neighbouring devices, on one node wherever S allows, and only the data-parallel
collectives (and pipelines longer than a node) cross the inter-node link.

>>> spec = ClusterSpec(devices=64, device_memory=parse_size("80GiB"))
>>> spec.nodes, spec.intra_bandwidth, spec.inter_bandwidth
(8, 200000000000.0, 25000000000.0)
>>> ClusterSpec.from_dict(spec.to_dict()) == spec
True
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fxpipe.errors import ConfigError
from fxpipe.jsonio import dump_json, load_json
from fxpipe.partitioner.cost import LINK_PRESETS, CostModel, format_size, parse_size
from fxpipe.schema import read_dataclass

__all__ = ["ClusterSpec", "CUSTOM_LINK"]

CUSTOM_LINK = "custom"  # a link given by bandwidth and latency alone


@dataclass(frozen=True)
class ClusterSpec:
    """``devices`` devices of ``device_memory`` bytes (``None``: unbounded), ``node_size`` to a node.

    Devices in one node talk over ``intra_link``, nodes over ``inter_link`` (names from
    ``LINK_PRESETS``, or ``"custom"``). ``*_bandwidth`` (bytes/s, one direction) and
    ``*_latency`` (seconds per message) default to the preset's; given, they override it.
    """

    devices: int
    device_memory: int | None = None
    node_size: int = 8
    intra_link: str = "nvlink"
    inter_link: str = "infiniband"
    intra_bandwidth: float | None = None
    intra_latency: float | None = None
    inter_bandwidth: float | None = None
    inter_latency: float | None = None

    def __post_init__(self) -> None:
        for key in ("devices", "node_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"cluster {key} must be an int >= 1, got {value!r}")
        if self.device_memory is not None and (
            isinstance(self.device_memory, bool)
            or not isinstance(self.device_memory, int)
            or self.device_memory < 1
        ):
            raise ConfigError(
                f"cluster device_memory must be a positive number of bytes, got {self.device_memory!r}"
            )
        for side in ("intra", "inter"):
            link = getattr(self, f"{side}_link")
            bandwidth, latency = (
                getattr(self, f"{side}_bandwidth"),
                getattr(self, f"{side}_latency"),
            )
            if link not in LINK_PRESETS:
                if link != CUSTOM_LINK or bandwidth is None or latency is None:
                    raise ConfigError(
                        f"unknown {side}-node link {link!r}; expected one of "
                        f"{sorted(LINK_PRESETS)}, or give its bandwidth and latency"
                    )
            preset = LINK_PRESETS.get(link, (math.nan, math.nan))
            bandwidth = preset[0] if bandwidth is None else bandwidth
            latency = preset[1] if latency is None else latency
            if (
                isinstance(bandwidth, bool)
                or not isinstance(bandwidth, (int, float))
                or not math.isfinite(bandwidth)
                or bandwidth <= 0
            ):
                raise ConfigError(
                    f"{side}-node bandwidth must be a finite number of bytes/s > 0, got {bandwidth!r}"
                )
            if (
                isinstance(latency, bool)
                or not isinstance(latency, (int, float))
                or not math.isfinite(latency)
                or latency < 0
            ):
                raise ConfigError(
                    f"{side}-node latency must be a finite number of seconds >= 0, got {latency!r}"
                )
            object.__setattr__(self, f"{side}_bandwidth", float(bandwidth))
            object.__setattr__(self, f"{side}_latency", float(latency))

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.node_size)

    def cost_model(self, replicas: int = 1, **overrides: Any) -> CostModel:
        """The cost model of a configuration with ``replicas`` pipeline replicas on this cluster:
        the intra-node link for messages, the inter-node one where a message or collective
        crosses nodes (Note [cluster links])."""
        assert (
            self.intra_bandwidth is not None and self.intra_latency is not None
        )  # set in __post_init__
        return CostModel(
            link_bandwidth=self.intra_bandwidth,
            link_latency=self.intra_latency,
            link=self.intra_link,
            node_size=self.node_size,
            inter_link_bandwidth=self.inter_bandwidth,
            inter_link_latency=self.inter_latency,
            dp_replicas=replicas,
            **overrides,
        )

    def describe(self) -> str:
        """One line: ``64 devices (8 nodes of 8), 80 GiB each; nvlink 200 GB/s in a node, infiniband 25 GB/s between``."""
        memory = (
            f", {format_size(self.device_memory)} each" if self.device_memory is not None else ""
        )
        intra, inter = (
            self.intra_bandwidth or 0.0,
            self.inter_bandwidth or 0.0,
        )  # set in __post_init__
        nodes = f"{self.nodes} nodes of {self.node_size}" if self.nodes > 1 else "one node"
        return (
            f"{self.devices} devices ({nodes}){memory}; "
            f"{self.intra_link} {intra / 1e9:.3g} GB/s in a node, {self.inter_link} {inter / 1e9:.3g} GB/s between"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterSpec:
        """A cluster from JSON data, every field checked (``ConfigError`` naming the field)."""
        return read_dataclass(cls, d, "cluster", ConfigError)

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self.to_dict(), path, what="cluster", error=ConfigError)

    @classmethod
    def from_json(cls, source: str | Path) -> ClusterSpec:
        """A cluster from a JSON file or JSON text."""
        return cls.from_dict(load_json(source, "cluster", ConfigError))

    @classmethod
    def from_options(
        cls,
        devices: int,
        *,
        device_memory: str | int | None = None,
        node_size: int = 8,
        intra_link: str = "nvlink",
        inter_link: str = "infiniband",
        intra_bandwidth_gbs: float | None = None,
        intra_latency_us: float | None = None,
        inter_bandwidth_gbs: float | None = None,
        inter_latency_us: float | None = None,
    ) -> ClusterSpec:
        """A cluster from command-line units: memory as a size (``"80GiB"``), GB/s and microseconds."""

        def scaled(value: float | None, factor: float) -> float | None:
            return None if value is None else value * factor

        def link(name: str, bandwidth: float | None, latency: float | None) -> str:
            return (
                CUSTOM_LINK
                if name not in LINK_PRESETS and bandwidth is not None and latency is not None
                else name
            )

        try:
            memory = parse_size(device_memory) if device_memory is not None else None
        except ConfigError as exc:
            raise ConfigError(f"--device-memory: {exc}") from None
        return cls(
            devices=devices,
            device_memory=memory,
            node_size=node_size,
            intra_link=link(intra_link, intra_bandwidth_gbs, intra_latency_us),
            inter_link=link(inter_link, inter_bandwidth_gbs, inter_latency_us),
            intra_bandwidth=scaled(intra_bandwidth_gbs, 1e9),
            intra_latency=scaled(intra_latency_us, 1e-6),
            inter_bandwidth=scaled(inter_bandwidth_gbs, 1e9),
            inter_latency=scaled(inter_latency_us, 1e-6),
        )
