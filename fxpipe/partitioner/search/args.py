"""The command-line flags of the cluster search (``fxpipe plan/partition --devices``); imports nothing heavy."""

from __future__ import annotations

import argparse

__all__ = ["add_cluster_arguments"]


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """``--devices N --device-memory 80GiB --node-size 8 --intra-link/--inter-link`` (presets, or
    ``--*-bandwidth`` GB/s and ``--*-latency`` µs), ``--global-batch G``, ``--top K``, ``--explain``."""
    g = p.add_argument_group("cluster search (fxpipe.partitioner.search.configurations): choose S x R x M x schedule x shard x "
                             "recompute for N devices (with --stages S: at that depth)")
    g.add_argument("--devices", type=int, default=None, metavar="N", help="devices in the cluster")
    g.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="memory per device, e.g. 80GiB (default --memory-limit, else unbounded)")
    g.add_argument("--node-size", type=int, default=8, metavar="K", help="devices per node (default 8)")
    g.add_argument("--intra-link", default="nvlink", help="link inside a node: a preset (default nvlink)")
    g.add_argument("--inter-link", default="infiniband", help="link between nodes: a preset (default infiniband)")
    for side in ("intra", "inter"):
        g.add_argument(f"--{side}-bandwidth", type=float, default=None, metavar="GB/S",
                       help=f"{side}-node bandwidth in GB/s (overrides the preset)")
        g.add_argument(f"--{side}-latency", type=float, default=None, metavar="US",
                       help=f"{side}-node latency per message in microseconds (overrides the preset)")
    g.add_argument("--global-batch", type=int, default=None, metavar="G",
                   help="samples per step over all replicas (with --devices; required)")
    g.add_argument("--top", type=int, default=5, metavar="K", help="configurations to list (default 5)")
    g.add_argument("--explain", action="store_true", help="say why the other depths, schedules and shardings lose")
