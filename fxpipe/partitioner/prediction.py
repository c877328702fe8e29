"""Step prediction: a split's step time under each schedule, its bubble and per-stage memory.

Note [step prediction]: ``predict`` simulates the schedule (``simulate_schedule``) with
what the runtime really does per action and per step, which on small models is most of
a step (measured on 2 CPU ranks with gloo, see benchmarks/prediction):

* every F or B action pays the executor's bookkeeping (``RuntimeCosts.action_ms``) and,
  per message it sends or receives, the CPU cost of posting and completing it
  (``message_ms``); the message itself delays the consumer by the link time
  ``CostModel.message_ms(bytes)`` (simulated as a link delay, not as stage time);
* once per step, after the pipeline drains: one all-reduce per tied parameter shared by
  several stages (two link messages of its bytes), the loss broadcast (one small
  message), and the slowest stage's ``zero_grad`` + optimizer step (a fixed cost per
  parameter tensor plus streaming its bytes, weight + gradient + optimizer state), plus
  a fixed ``step_ms`` of Python around the step.

The solver's stage costs (``evaluate``) are unchanged; only the prediction adds these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fxpipe.errors import PartitionError
from fxpipe.partitioner.problem import PartitionProblem, evaluate
from fxpipe.partitioner.schedule import SCHEDULE_NAMES, simulate_schedule
from fxpipe.schema import NonNegFloat, NonNegInt

__all__ = ["RuntimeCosts", "RUNTIME_COSTS", "StepOverheads", "Prediction", "predict", "step_overheads",
           "PREDICTED_SCHEDULES"]

PREDICTED_SCHEDULES = SCHEDULE_NAMES  # every schedule the runtime runs is predicted
_LOSS_BYTES = 4                # the step's loss, broadcast from the last stage as one float32


@dataclass(frozen=True)
class RuntimeCosts:
    """Fixed costs of fxpipe's runtime beyond unit compute and link time (Note [step prediction])."""

    action_ms: NonNegFloat = 0.0             # executor bookkeeping per F or B action (buffers, dicts, checks)
    message_ms: NonNegFloat = 0.0            # CPU time per message to post and complete it, on each end
    loss_ms: NonNegFloat = 0.0               # loss forward + backward per microbatch, on the last stage
    step_ms: NonNegFloat = 0.0               # Python per step: zero_grad, microbatch split, loss stack, ...
    optimizer_step_ms: NonNegFloat = 0.0     # fixed cost of one optimizer.step() call
    optimizer_tensor_ms: NonNegFloat = 0.0   # ... plus this per parameter tensor
    optimizer_bytes_per_s: NonNegFloat = 0.0  # ... plus streaming weight, gradient and state; 0: free

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


# "cpu": fxpipe.runtime on 2 CPU ranks, gloo on loopback, one thread each, torch 2.13, on
# this project's 2-core machine. Timers around StageWorker.forward/backward (minus the
# stage module and autograd calls), P2P.post, loss_fn and optimizer.step of a running
# job (examples/gpt.py and mlp.py, 4 microbatches): bookkeeping ~40 us per action, posting
# ~70-200 us per batch of messages, SGD.step ~0.12 ms + ~6 us per tensor, ~0.25 ms per
# step around the executor. Link times come from the CostModel (loopback: ~50 us one way
# measured with a gloo ping-pong, 100 us in LINK_PRESETS). See benchmarks/prediction/README.md.
RUNTIME_COSTS: dict[str, RuntimeCosts] = {
    "cpu": RuntimeCosts(action_ms=0.04, message_ms=0.15, loss_ms=0.05, step_ms=0.25, optimizer_step_ms=0.12,
                        optimizer_tensor_ms=0.006, optimizer_bytes_per_s=10e9),
    "cuda": RuntimeCosts(action_ms=0.04, message_ms=0.03, loss_ms=0.05, step_ms=0.25, optimizer_step_ms=0.12,
                         optimizer_tensor_ms=0.006, optimizer_bytes_per_s=1e12),
}


@dataclass(frozen=True)
class StepOverheads:
    """Milliseconds a step spends after the pipeline drains (Note [step prediction])."""

    tied_all_reduce_ms: NonNegFloat = 0.0   # all-reduces of parameters held by several stages
    loss_broadcast_ms: NonNegFloat = 0.0    # the loss, from the last stage to the others
    optimizer_ms: NonNegFloat = 0.0         # the slowest stage's zero_grad + optimizer step
    dp_all_reduce_ms: NonNegFloat = 0.0     # the slowest stage's data-parallel all-reduce (or sharded collectives)
    fixed_ms: NonNegFloat = 0.0             # RuntimeCosts.step_ms

    @property
    def total_ms(self) -> float:
        return self.tied_all_reduce_ms + self.loss_broadcast_ms + self.optimizer_ms + self.dp_all_reduce_ms \
            + self.fixed_ms


@dataclass(frozen=True)
class Prediction:
    """A split's predicted step under every schedule in ``PREDICTED_SCHEDULES``.

    Per schedule: ``step_ms`` (the whole step) = ``pipeline_ms`` (the simulated forward and
    backward part) + ``step_overhead_ms.total_ms``; ``bubble_by_schedule`` the idle share of
    the pipeline part; ``peak_memory_bytes_by_schedule`` each stage's peak memory. The
    properties answer for ``schedule``, the plan's own. ``runtime_costs`` are the fixed
    runtime costs the prediction assumed.
    """

    schedule: str
    step_ms: dict[str, NonNegFloat]
    pipeline_ms: dict[str, NonNegFloat]
    bubble_by_schedule: dict[str, NonNegFloat]
    peak_memory_bytes_by_schedule: dict[str, tuple[NonNegInt, ...]]
    step_overhead_ms: StepOverheads
    runtime_costs: RuntimeCosts
    samples_per_step: NonNegInt

    def __post_init__(self) -> None:
        for name in ("step_ms", "pipeline_ms", "bubble_by_schedule", "peak_memory_bytes_by_schedule"):
            if self.schedule not in getattr(self, name):
                raise PartitionError(f"prediction {name} has no entry for its schedule {self.schedule!r}")

    @property
    def bubble(self) -> float:
        return self.bubble_by_schedule[self.schedule]

    @property
    def peak_memory_bytes(self) -> tuple[int, ...]:
        return self.peak_memory_bytes_by_schedule[self.schedule]

    @property
    def throughput_samples_per_s(self) -> float:
        step = self.step_ms[self.schedule]
        return self.samples_per_step / (step / 1e3) if step > 0 else float("inf")


def _messages(problem: PartitionProblem, assignment: tuple[int, ...]) -> tuple[list[int], list[int], list[float],
                                                                                list[float]]:
    """Per microbatch: messages each stage handles in forward and in backward, and the link
    time of activations into stage i+1 and of gradients back into stage i (index i)."""
    S = problem.num_stages
    n_fwd, n_bwd = [0] * S, [0] * S
    fwd_bytes, bwd_bytes = [0] * S, [0] * S  # received by stage (activations) / by stage (gradients)
    fwd_msgs, bwd_msgs = [0] * S, [0] * S
    for t in problem.tensors:
        a = assignment[t.producer]
        for d in {assignment[c] for c in t.consumers} - {a}:
            n_fwd[a] += 1
            n_fwd[d] += 1
            fwd_bytes[d] += t.nbytes
            fwd_msgs[d] += 1
            if t.requires_grad:
                n_bwd[a] += 1
                n_bwd[d] += 1
                bwd_bytes[a] += t.nbytes
                bwd_msgs[a] += 1
    cost = problem.cost

    def link(nbytes: int, count: int) -> float:
        return cost.message_ms(nbytes) if count else 0.0

    send = [link(fwd_bytes[i + 1], fwd_msgs[i + 1]) for i in range(S - 1)] + [0.0]
    grad = [link(bwd_bytes[i], bwd_msgs[i]) for i in range(S - 1)] + [0.0]
    return n_fwd, n_bwd, send, grad


def step_overheads(problem: PartitionProblem, assignment: tuple[int, ...], runtime: RuntimeCosts) -> StepOverheads:
    """What a step spends after the pipeline drains (Note [step prediction]):
    tied-parameter all-reduces, the loss broadcast, the slowest optimizer step, the slowest
    stage's data-parallel gradient all-reduce (``CostModel.allreduce_ms``), fixed Python."""
    S = problem.num_stages
    stages_of: dict[int, set[int]] = {}
    for u, s in enumerate(assignment):
        for p in problem.unit_params[u]:
            stages_of.setdefault(p, set()).add(s)
    tied = sum(2 * problem.cost.message_ms(problem.param_bytes[p]) for p, st in stages_of.items() if len(st) > 1)
    broadcast = problem.cost.message_ms(_LOSS_BYTES) if S > 1 else 0.0
    touched = 3 + 2 * problem.cost.optimizer_factor  # read weight and gradient, write weight; state in and out
    optimizer = dp_all_reduce = 0.0
    for s in range(S):
        mine = [p for p, st in stages_of.items() if s in st]
        dp_all_reduce = max(dp_all_reduce, problem.dp_allreduce_ms(mine))
        nbytes = sum(problem.param_bytes[p] for p in mine) / problem.cost.optimizer_shards  # sharded: its share
        stream = touched * nbytes / runtime.optimizer_bytes_per_s * 1e3 if runtime.optimizer_bytes_per_s > 0 else 0.0
        if mine:
            optimizer = max(optimizer, runtime.optimizer_step_ms + len(mine) * runtime.optimizer_tensor_ms + stream)
    return StepOverheads(tied_all_reduce_ms=float(tied), loss_broadcast_ms=broadcast, optimizer_ms=optimizer,
                         dp_all_reduce_ms=dp_all_reduce, fixed_ms=runtime.step_ms)


def predict(problem: PartitionProblem, assignment: tuple[int, ...], microbatch_size: int, *,
            runtime: RuntimeCosts | None = None) -> Prediction:
    """Step time under both schedules (simulated, plus per-step overheads), bubble,
    throughput and per-stage peak memory (Note [step prediction]).

    ``runtime`` defaults to ``RUNTIME_COSTS["cpu"]``.
    """
    rt = runtime if runtime is not None else RUNTIME_COSTS["cpu"]
    n_fwd, n_bwd, send, grad = _messages(problem, assignment)
    overhead = step_overheads(problem, assignment, rt)
    step_ms: dict[str, float] = {}
    pipeline_ms: dict[str, float] = {}
    bubble: dict[str, float] = {}
    memory: dict[str, tuple[int, ...]] = {}
    last = problem.num_stages - 1
    for schedule in PREDICTED_SCHEDULES:
        ev = evaluate(replace(problem, schedule=schedule), assignment)
        fwd = [s.fwd_ms + rt.action_ms + n_fwd[i] * rt.message_ms + (rt.loss_ms / 2 if i == last else 0.0)
               for i, s in enumerate(ev.stages)]
        bwd = [s.bwd_ms + rt.action_ms + n_bwd[i] * rt.message_ms + (rt.loss_ms / 2 if i == last else 0.0)
               for i, s in enumerate(ev.stages)]
        line = simulate_schedule(fwd, bwd, problem.microbatches, schedule, send_ms=send, grad_send_ms=grad)
        pipeline_ms[schedule] = line.step_ms
        step_ms[schedule] = line.step_ms + overhead.total_ms
        bubble[schedule] = line.bubble
        memory[schedule] = tuple(s.memory_bytes for s in ev.stages)
    return Prediction(schedule=problem.schedule, step_ms=step_ms, pipeline_ms=pipeline_ms, bubble_by_schedule=bubble,
                      peak_memory_bytes_by_schedule=memory, step_overhead_ms=overhead, runtime_costs=rt,
                      samples_per_step=problem.microbatches * microbatch_size)
