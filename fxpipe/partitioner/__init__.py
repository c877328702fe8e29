"""Partitioner: cost model, solvers (exact DP, CP-SAT, baselines), plan, reports, schedule simulator.

Pure Python (numpy, networkx, OR-Tools); it reads a ``ModelProfile`` and never imports torch.
Names load on first use, so reading ``fxpipe.partitioner.schedule.SCHEDULE_NAMES`` (the CLI's
parser does) does not import OR-Tools.

>>> from fxpipe.partitioner import plan_partition, parse_size
>>> plan = plan_partition(profile, 4, microbatches=8, memory_limit=parse_size("16GiB"))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe._lazy import lazy_exports, type_checking_exports

if TYPE_CHECKING:
    from fxpipe.partitioner.solve.baselines import (
        BASELINES,
        greedy_split,
        params_split,
        run_baseline,
        uniform_split,
    )
    from fxpipe.partitioner.solve.solution import lower_bound
    from fxpipe.partitioner.cost import (
        LINK_PRESETS,
        OPTIMIZER_STATE_FACTOR,
        CostModel,
        format_size,
        parse_size,
    )
    from fxpipe.partitioner.solve.cpsat import solve_dag_cpsat
    from fxpipe.partitioner.solve.dp import min_memory_limit, solve_chain_dp
    from fxpipe.partitioner.report.html import render_html_report, write_html_report
    from fxpipe.partitioner.plan import BaselineReport, PartitionPlan, StageMemory, StagePlan
    from fxpipe.partitioner.solve.planner import SOLVERS, plan_partition
    from fxpipe.partitioner.prediction import (
        RUNTIME_COSTS,
        Prediction,
        RuntimeCosts,
        StepOverheads,
        predict,
        step_overheads,
    )
    from fxpipe.partitioner.problem import (
        Evaluation,
        PartitionProblem,
        StageCost,
        assignment_violations,
        build_problem,
        evaluate,
    )
    from fxpipe.partitioner.report.terminal import print_plan_report
    from fxpipe.partitioner.schedule import SCHEDULE_NAMES, ScheduleOp, Timeline, stage_order
    from fxpipe.partitioner.solve.solution import Solution

# the names above, imported on first use (Note [one list of lazy names] in fxpipe._lazy)
_LAZY = type_checking_exports(__file__)
__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
