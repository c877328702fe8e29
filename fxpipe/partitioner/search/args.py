"""``ClusterOptions``: the command-line flags of the cluster search (``fxpipe plan/partition --devices``).

Declared once as fields (Note [options declared once] in ``fxpipe.optionspec``); imports
nothing heavy, so the CLI builds its parsers from it at start-up.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from fxpipe.optionspec import Options, add_arguments, option

__all__ = ["ClusterOptions", "add_cluster_arguments"]


@dataclass(frozen=True, kw_only=True)
class ClusterOptions(Options):
    """``--devices N --device-memory 80GiB --node-size 8 --intra-link/--inter-link`` (presets, or
    ``--*-bandwidth`` GB/s and ``--*-latency`` µs), ``--global-batch G``, ``--top K``, ``--explain``."""

    what: ClassVar[str] = "cluster search options"

    devices: int | None = option(
        None, metavar="N", none_means="no search", help="devices in the cluster"
    )
    device_memory: str | None = option(
        None,
        metavar="SIZE",
        none_means="--memory-limit, else unbounded",
        help="memory per device, e.g. 80GiB",
    )
    node_size: int = option(8, metavar="K", help="devices per node")
    intra_link: str = option("nvlink", metavar="NAME", help="link inside a node: a preset")
    inter_link: str = option("infiniband", metavar="NAME", help="link between nodes: a preset")
    intra_bandwidth: float | None = option(
        None,
        metavar="GB/S",
        none_means="the preset's",
        help="intra-node bandwidth in GB/s (overrides the preset)",
    )
    intra_latency: float | None = option(
        None,
        metavar="US",
        none_means="the preset's",
        help="intra-node latency per message in microseconds (overrides the preset)",
    )
    inter_bandwidth: float | None = option(
        None,
        metavar="GB/S",
        none_means="the preset's",
        help="inter-node bandwidth in GB/s (overrides the preset)",
    )
    inter_latency: float | None = option(
        None,
        metavar="US",
        none_means="the preset's",
        help="inter-node latency per message in microseconds (overrides the preset)",
    )
    global_batch: int | None = option(
        None,
        metavar="G",
        none_means="none; required with --devices",
        help="samples per step over all replicas",
    )
    top: int = option(5, metavar="K", help="configurations to list")
    explain: bool = option(False, help="say why the other depths, schedules and shardings lose")


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``ClusterOptions``' flags to ``p``, in their own help group."""
    add_arguments(
        p,
        ClusterOptions,
        title="cluster search (fxpipe.partitioner.search.configurations): choose S x R x M x schedule x "
        "shard x recompute for N devices (with --stages S: at that depth)",
    )
