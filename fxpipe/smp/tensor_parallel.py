"""The seed config's ``tensor_parallel_degree``: the partitioned stage split as ``fxpipe run --tp`` does.

With ``tensor_parallel_degree`` T > 1, ``init`` lays the ranks out as the runtime does
(``RankLayout``: the mesh ``(dp, pp, tp)``, tp innermost) and makes the mesh; right after the
first step partitions the model, each rank finds its stage's plan (``fxpipe.codegen.tp_plan``,
the same rules as a build's ``tp_plan.json``; with ``plan=DIR`` that directory's file, which a
user may have edited) and applies it with the runtime's ``parallelize_stage`` (Note [DTensor
regions] in ``fxpipe.runtime.pipeline.tensor_parallel``). So a stage's inputs and outputs stay
plain, replicated tensors and the seed API's driver, P2P and loss code run unchanged; each tp
index of a replica is a pipeline of its own.

Unlike ``fxpipe run --tp``, which keeps a group whole when T does not divide its heads or
features (said in the plan's summary), a seed config names one degree for the model: a degree
that leaves a splittable group whole is refused with one line naming the group and why.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fxpipe.codegen.tp_plan import (
    TP_PLAN_FILE,
    ResolvedStagePlan,
    StageTPPlan,
    find_stage_plan,
    read_tp_plan,
)
from fxpipe.errors import ConfigError
from fxpipe.runtime.pipeline.tensor_parallel import implicit_replication_on, parallelize_stage

__all__ = ["stage_plans", "split_stages"]


def _resolved(plan: StageTPPlan, degree: int) -> ResolvedStagePlan:
    """``plan`` at ``degree``; refuses a degree that keeps a pair whole that degree 1 splits (GQA's
    K and V may stay replicated alone, Note [tensor-parallel rules])."""
    want, got = plan.for_degree(1), plan.for_degree(degree)
    lost = [group for group in want.groups if group not in got.groups]
    if lost:
        members = [path for path in want.styles if path not in got.styles]
        why = {k.path: k.reason for k in got.replicated}
        reason = next((why[p] for p in members if p in why), f"{lost[0]} stays whole")
        raise ConfigError(
            f"config 'tensor_parallel_degree' {degree} cannot split stage {plan.stage}: "
            f"{reason}; choose a degree that divides every split layer's heads and features, or 1"
        )
    return got


def stage_plans(
    chunks: dict[int, nn.Module], degree: int, build_dir: Any = None
) -> dict[int, ResolvedStagePlan]:
    """The plan of each of this rank's stages at ``degree``: the build directory's ``tp_plan.json``
    when there is one, else found from the stage modules (the rules ``write_build_dir`` applies)."""
    from pathlib import Path

    if build_dir is not None and (Path(build_dir) / TP_PLAN_FILE).is_file():
        whole = read_tp_plan(build_dir)
        return {i: _resolved(whole.stage(i), degree) for i in chunks}
    return {i: _resolved(find_stage_plan(m, i), degree) for i, m in chunks.items()}


def split_stages(
    chunks: dict[int, nn.Module], degree: int, mesh: Any, context: Any, build_dir: Any = None
) -> dict[int, ResolvedStagePlan]:
    """Split this rank's stages over the tp ``mesh`` (collective over it: the full weights are
    distributed from its first rank) and turn implicit replication on in ``context`` (an
    ``ExitStack`` closed at ``shutdown``); returns the plans applied."""
    plans = stage_plans(chunks, degree, build_dir)
    for index, module in chunks.items():
        parallelize_stage(module, plans[index], mesh)
    context.enter_context(implicit_replication_on())
    return plans
