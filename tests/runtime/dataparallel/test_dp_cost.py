"""The data-parallel terms of the cost model, and option validation (no processes)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fxpipe.errors import ConfigError
from fxpipe.partitioner import CostModel, plan_partition
from fxpipe.partitioner.problem import build_problem, evaluate
from fxpipe.runtime import RankLayout
from fxpipe.runtime.dataparallel import DataParallelOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "partitioner"))
from partition_fixtures import chain_profile  # noqa: E402

MB = 10**6


def test_ring_allreduce_formula_and_hook_compression() -> None:
    cost = CostModel(link_bandwidth=1e9, link_latency=1e-4, dp_replicas=4)
    # 2(R-1)/R x bytes / bandwidth + 2(R-1) ring hops x latency = 1.5 x 4 MB / 1 GB/s + 6 x 0.1 ms
    assert cost.allreduce_ms([4 * MB]) == pytest.approx(6.0 + 0.6)
    assert replace(cost, dp_replicas=1).allreduce_ms([4 * MB]) == 0.0
    assert cost.allreduce_ms([]) == 0.0
    assert replace(cost, comm_hook="fp16").allreduce_ms([4 * MB]) == pytest.approx(3.0 + 0.6)
    # PowerSGD rank r on a 1000 x 1000 fp32 matrix sends (1000 + 1000) x r floats
    psgd = replace(cost, comm_hook="powersgd", powersgd_rank=4)
    assert psgd.gradient_bytes(4 * MB) == pytest.approx(2000 * 4 * 4)
    assert (
        psgd.gradient_bytes(64) == 64
    )  # a tiny tensor is not worth compressing (PowerSGD leaves it)
    with pytest.raises(ConfigError, match="dp_replicas must be an int >= 1, got 0"):
        CostModel(dp_replicas=0)
    with pytest.raises(ConfigError, match="unknown comm_hook 'int8'"):
        CostModel(comm_hook="int8")


def test_stage_costs_and_prediction_include_the_allreduce() -> None:
    profile = chain_profile([1.0, 1.0, 1.0, 1.0], params=[8 * MB, 0, 0, 2 * MB])
    cost = CostModel(link_bandwidth=1e9, link_latency=0.0, dp_replicas=2)
    problem = build_problem(profile, 2, microbatches=4, cost=cost)
    stages = evaluate(problem, (0, 0, 1, 1)).stages
    assert [s.dp_allreduce_ms for s in stages] == pytest.approx(
        [8.0, 2.0]
    )  # 2(1)/2 x bytes / 1 GB/s
    single = plan_partition(profile, 2, microbatches=4, cost=replace(cost, dp_replicas=1))
    dual = plan_partition(profile, 2, microbatches=4, cost=cost)
    added = dual.step_ms - single.step_ms
    assignment = tuple(
        next(i for i, st in enumerate(dual.stages) if u.name in st.units) for u in profile.units
    )
    per_stage = [s.dp_allreduce_ms for s in evaluate(problem, assignment).stages]
    slowest = max(per_stage)
    # plus the ring's hops at the runtime's per-hop cost of a collective (2 hops on 2 replicas)
    hops = cost.dp_hops([8 * MB])  # the slowest stage's one bucket: 2(R - 1) hops
    assert hops == 2
    # and DDP's synchronising pass around it, per step and per parameter tensor (one here; Note [data-parallel
    # sync cost])
    runtime = dual.prediction.runtime_costs
    sync_pass = runtime.dp_sync_ms + 1 * runtime.dp_sync_tensor_ms
    assert (
        added == pytest.approx(slowest + hops * runtime.collective_ms + sync_pass) and slowest > 0
    )
    assert [s.dp_allreduce_ms for s in dual.stages] == pytest.approx(
        per_stage
    )  # plan.json carries it per stage
    assert all(s.dp_allreduce_ms == 0.0 for s in single.stages)
    assert dual.prediction.step_overhead_ms.dp_all_reduce_ms == pytest.approx(
        slowest + hops * runtime.collective_ms + sync_pass
    )
    assert dual.cost.dp_replicas == 2 and dual.cost == cost == CostModel.from_dict(
        dual.cost.to_dict()
    )


def test_options_refuse_bad_values_with_the_remedy() -> None:
    with pytest.raises(ConfigError, match="backward_passes_per_step must be an int >= 1, got 0"):
        DataParallelOptions(backward_passes_per_step=0)
    with pytest.raises(ConfigError, match=r"unknown comm_hook 'int8'.*register_comm_hook"):
        DataParallelOptions(comm_hook="int8")
    with pytest.raises(ConfigError, match="powersgd_start_iter must be an int >= 2"):
        DataParallelOptions(powersgd_start_iter=1)
    assert DataParallelOptions(overlapping_allreduce=False).ddp_kwargs()["bucket_cap_mb"] >= 1e6


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("comm_hook", "int8", r"unknown comm_hook 'int8'; expected one of .*register_comm_hook"),
        ("powersgd_rank", 0, r"powersgd_rank must be an int >= 1, got 0; 1, 2 or 4 are usual"),
        ("powersgd_rank", True, r"powersgd_rank must be an int >= 1, got True"),
        ("shard", "zero3", r"unknown shard level 'zero3'; expected one of"),
        ("shard_reduce", "never", r"unknown shard_reduce 'never'; expected one of"),
        ("shard_param_dtype", "int8", r"shard_param_dtype must be one of .*got 'int8'"),
        ("shard_reduce_dtype", "int8", r"shard_reduce_dtype must be one of .*got 'int8'"),
    ],
)
def test_the_planner_and_the_runtime_refuse_a_bad_value_with_one_line(
    field: str, value: object, message: str
) -> None:
    """Note [options declared once]: the check is declared with the option, so the cost model
    (fxpipe plan) and the runtime's options (fxpipe run, the seed API) say the same line."""
    shard = {"shard": "full"} if field.startswith("shard_") else {}
    lines = []
    for cls in (CostModel, DataParallelOptions):
        with pytest.raises(ConfigError, match=message) as caught:
            cls(**{**shard, field: value})
        lines.append(str(caught.value))
    assert lines[0] == lines[1] and "\n" not in lines[0]


def test_data_parallel_peers_are_one_stage_of_every_replica() -> None:
    layout = RankLayout(num_stages=2, replicas=2)
    assert layout.pipeline_ranks(0) == (0, 1) and layout.data_parallel_ranks(1) == (1, 3)


_POWERSGD_PROBE = """
import json, os
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

torch.manual_seed(0)
# conv 16 x 27 and linear 32 x 576 are compressed; biases, LayerNorm and the 3 x 32 head are not
model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), nn.Linear(16 * 6 * 6, 32), nn.LayerNorm(32), nn.Linear(32, 3))
sent = []
all_reduce = dist.all_reduce

def counting(tensor, *args, **kwargs):
    sent.append(tensor.numel() * tensor.element_size())
    return all_reduce(tensor, *args, **kwargs)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                    random_seed=0)
ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
dist.all_reduce = counting
x = torch.randn(4, 3, 8, 8)
for _ in range(3):  # two plain steps, then PowerSGD
    sent.clear()
    ddp(x).sum().backward()
params = [[p.numel() * p.element_size(), list(p.shape)] for p in model.parameters()]
print(json.dumps({"sent": sent, "params": params}), flush=True)
os._exit(0)  # skip tearing down gloo under DDP's reducer, which can hang in its thread join
"""


def test_powersgd_pricing_matches_what_torch_hook_all_reduces() -> None:
    """One DDP replica (1-process gloo group, in a subprocess) with torch's powerSGD_hook: after
    its plain start steps, the bytes and the number of all-reduces it issues are what the cost
    model prices."""
    import json
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _POWERSGD_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    sent = probe["sent"]
    cost = CostModel(
        dp_replicas=2, comm_hook="powersgd", powersgd_rank=2, dp_bucket_bytes=25 * 2**20
    )
    traffic = cost.dp_traffic(
        [b for b, _ in probe["params"]], [tuple(shape) for _, shape in probe["params"]]
    )
    assert sent == [211 * 4, (32 + 64) * 4, (54 + 1152) * 4]  # uncompressed, P, Q
    assert (traffic.wire_bytes, traffic.allreduces) == (sum(sent), len(sent))


def test_options_price_the_buckets_ddp_really_uses() -> None:
    fields = DataParallelOptions(
        comm_hook="powersgd", powersgd_rank=2, bucket_cap_mb=5
    ).cost_fields(2)
    assert fields == {
        "dp_replicas": 2,
        "comm_hook": "powersgd",
        "powersgd_rank": 2,
        "dp_bucket_bytes": 5 * 2**20,
        "shard": "none",
        "shard_reduce": "step",
        "shard_param_dtype": None,
        "shard_reduce_dtype": None,
    }
    assert CostModel(**fields).dp_bucket_bytes == 5 * 2**20
    # without overlapping all-reduce DDP gets one huge bucket, and so does the cost model
    one = DataParallelOptions(overlapping_allreduce=False).cost_fields(4)["dp_bucket_bytes"]
    assert one >= 10**6 * 2**20
