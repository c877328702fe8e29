"""Terminal report of a cluster search (rich tables): the ranked configurations and, with ``explain``, why the rest lose."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from fxpipe.errors import ConfigError
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.optionspec import from_namespace
from fxpipe.partitioner.cost import format_size
from fxpipe.partitioner.plan_options import PlanOptions
from fxpipe.partitioner.schedule import AUTO
from fxpipe.partitioner.search.configurations import SearchResult, search_configurations
from fxpipe.partitioner.seqlen import priced_lengths

__all__ = ["print_search_report", "search_from_args"]

_GROUP_TITLES = {"depth": "pipeline depth S", "schedule": "schedule", "shard": "sharding level"}


def print_search_report(
    result: SearchResult, console: Console | None = None, *, explain: bool = False
) -> None:
    """One row per ranked configuration: throughput, step time, bubble, per-device memory and
    what limits it; with ``explain``, the best of each depth, schedule and sharding level and
    why it loses to the best (or why none of it fits)."""
    console = console or Console()
    title = (
        f"Top {len(result.ranked)} configurations on {result.cluster.describe()}; global batch "
        f"{result.global_batch}, {result.optimizer} (searched {result.candidates} shapes, priced "
        f"{result.priced}, simulated {result.simulated} in {result.seconds:.1f} s)"
    )
    if result.cost_fields:
        title += "; priced with the job's " + ", ".join(
            f"{name} {value}" for name, value in sorted(result.cost_fields.items())
        )
    table = Table(title=title, title_justify="left")
    for col in (
        "#",
        "S x R",
        "M x b",
        "schedule",
        "shard",
        "recompute",
        "samples/s (job)",
        "step",
        "bubble",
        "memory/device",
        "limited by",
    ):
        table.add_column(
            col,
            justify="left" if col in ("schedule", "shard", "limited by") else "right",
            no_wrap=col != "limited by",
        )
    for i, score in enumerate(result.ranked):
        c = score.config
        v = f" V={c.virtual_stages}" if c.virtual_stages > 1 else ""
        table.add_row(
            str(i + 1),
            f"{c.stages} x {c.replicas}",
            f"{c.microbatches} x {c.microbatch_size}",
            c.schedule + v,
            c.shard,
            f"{sum(c.recompute)}/{len(c.recompute)}" if any(c.recompute) else "-",
            f"{score.samples_per_s:.4g}",
            f"{score.step_ms / 1e3:.4g} s",
            f"{score.bubble:.0%}",
            format_size(score.peak_memory_bytes),
            score.limit,
        )
    console.print(table)
    if not explain:
        return
    for group, heading in _GROUP_TITLES.items():
        rows = [a for a in result.alternatives if a.group == group]
        if not rows:
            continue
        why = Table(title=f"Why not another {heading}", title_justify="left")
        why.add_column(heading, justify="right", no_wrap=True)
        why.add_column("best step", justify="right", no_wrap=True)
        why.add_column("why it loses")
        for a in rows:
            why.add_row(a.value, "-" if a.step_ms is None else f"{a.step_ms / 1e3:.4g} s", a.note)
        console.print(why)


def search_from_args(args: argparse.Namespace, profile: Any, console: Console) -> SearchResult:
    """The cluster search the command line asks for (``search_args``), printed; its result."""
    if args.global_batch is None:
        raise ConfigError(
            "--devices searches a cluster at a fixed global batch; add --global-batch G"
        )
    if args.dp != 1 or args.shard != "none":
        raise ConfigError(
            "--devices chooses the replicas and sharding itself; drop --dp and --shard (--stages S "
            "fixes the pipeline depth)"
        )
    cluster = ClusterSpec.from_options(
        args.devices,
        device_memory=args.device_memory or args.memory_limit,
        node_size=args.node_size,
        intra_link=args.intra_link,
        inter_link=args.inter_link,
        intra_bandwidth_gbs=args.intra_bandwidth,
        intra_latency_us=args.intra_latency,
        inter_bandwidth_gbs=args.inter_bandwidth,
        inter_latency_us=args.inter_latency,
    )
    schedules = (
        None if args.schedule in (AUTO, "1f1b") else (args.schedule,)
    )  # 1f1b is the flag's default
    result = search_configurations(
        profile,
        cluster,
        args.global_batch,
        optimizer=args.optimizer,
        schedules=schedules,
        stages=args.stages,
        top=args.top,
        cost_fields=from_namespace(PlanOptions, args).search_cost_fields(),
    )
    print_search_report(result, console, explain=args.explain)
    lengths = priced_lengths(profile)  # Note [pricing at a length]
    if len(lengths) == 1:
        console.print(f"configurations priced at {lengths[0].shown()}", markup=False)
    elif lengths:
        shown = ", ".join(f"{p.shown()} ({p.weight:.0%})" for p in lengths)
        console.print(
            f"configurations priced at the expected step over {shown}, memory at the longest",
            markup=False,
        )
    note = trace_device_note(profile.trace_device, profile.timing, cluster)
    if note:
        console.print(f"[yellow]warning: {note}[/]")
    return result


def trace_device_note(trace_device: str, timing: str, cluster: ClusterSpec) -> str | None:
    """A warning when the unit times come from another kind of device than the cluster's: a CPU trace
    priced on GPUs linked by NVLink, PCIe or InfiniBand predicts a step no GPU will run."""
    if trace_device != "cpu" or cluster.intra_link == "loopback":
        return None
    return (
        f"the unit times ({timing}) are for the CPU this profile was traced on, and the search prices them as "
        f"they are on {cluster.intra_link}-linked devices: the configurations rank by a CPU's speed and their "
        "step times are not a GPU's; trace on the cluster's kind of device (--trace-device cuda) for figures "
        "that hold there"
    )
