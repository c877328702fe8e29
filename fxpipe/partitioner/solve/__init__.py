"""Solving: which stage runs each unit.

``planner.plan_partition`` chooses a solver (the exact chain DP, CP-SAT over the unit DAG, or a
baseline), states the plan's gap to ``solution.lower_bound``, fits the memory limit over the
whole step (``memory_fit``), refines boundaries for step time (``refine``) and, for
``--schedule auto``, plans every schedule (``auto``). Each solver takes plain data (a
``PartitionProblem``) and returns a ``Solution``.
"""
