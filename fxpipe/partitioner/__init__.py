"""Partitioner: cost model, solvers (exact DP, CP-SAT, baselines), plan, reports, schedule simulator.

Pure Python (numpy, networkx, OR-Tools); it reads a ``ModelProfile`` and never imports torch.

>>> from fxpipe.partitioner import plan_partition, parse_size
>>> plan = plan_partition(profile, 4, microbatches=8, memory_limit=parse_size("16GiB"))  # doctest: +SKIP
"""

from fxpipe.partitioner.baselines import BASELINES, greedy_split, params_split, run_baseline, uniform_split
from fxpipe.partitioner.bounds import lower_bound
from fxpipe.partitioner.cost import LINK_PRESETS, OPTIMIZER_STATE_FACTOR, CostModel, format_size, parse_size
from fxpipe.partitioner.cpsat import solve_dag_cpsat
from fxpipe.partitioner.dp import min_memory_limit, solve_chain_dp
from fxpipe.partitioner.html import render_html_report, write_html_report
from fxpipe.partitioner.plan import BaselineReport, PartitionPlan, StageMemory, StagePlan
from fxpipe.partitioner.planner import SOLVERS, plan_partition
from fxpipe.partitioner.prediction import RUNTIME_COSTS, Prediction, RuntimeCosts, StepOverheads, predict, step_overheads
from fxpipe.partitioner.problem import (
    Evaluation,
    PartitionProblem,
    StageCost,
    assignment_violations,
    build_problem,
    evaluate,
)
from fxpipe.partitioner.report import print_plan_report
from fxpipe.partitioner.schedule import ScheduleOp, Timeline, simulate_schedule, stage_order
from fxpipe.partitioner.solution import Solution

__all__ = [
    "BASELINES", "LINK_PRESETS", "OPTIMIZER_STATE_FACTOR", "RUNTIME_COSTS", "SOLVERS",
    "BaselineReport", "CostModel", "Evaluation", "PartitionPlan", "PartitionProblem", "Prediction", "RuntimeCosts",
    "ScheduleOp", "Solution", "StageCost", "StageMemory", "StagePlan", "StepOverheads", "Timeline",
    "assignment_violations", "build_problem", "evaluate", "format_size", "greedy_split",
    "lower_bound", "min_memory_limit", "params_split", "parse_size", "plan_partition", "predict",
    "print_plan_report", "render_html_report", "run_baseline", "simulate_schedule", "solve_chain_dp",
    "solve_dag_cpsat", "stage_order", "step_overheads", "uniform_split", "write_html_report",
]
