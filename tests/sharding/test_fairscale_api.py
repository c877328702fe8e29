"""``fxpipe.sharding``: FairScale's examples, ported by changing imports, train like plain DDP.

Each script of examples/fairscale_scripts runs on 2 gloo ranks through the one spawn
helper and must end where the same loop under ``DistributedDataParallel`` ends (fp32:
rtol 1e-5). FairScale arguments without a torch counterpart are errors naming them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import auto_wrap as auto_wrap_script
import common
import fsdp as fsdp_script
import grad_scaler as grad_scaler_script
import oss_sharded_ddp
from fxpipe.errors import ConfigError
from fxpipe.sharding import (
    OSS,
    FullyShardedDataParallel,
    ShardedDataParallel,
    auto_wrap,
    enable_wrap,
    wrap,
)
from spawn import spawn

WORLD, EPOCHS = common.WORLD_SIZE, common.EPOCHS
TIMEOUT = 300  # several trainings per job (bf16 autocast on CPU is slow): room for a loaded machine


def _values(results: list[Any]) -> list[dict[str, Any]]:
    return [r.value for r in results]


@pytest.fixture(scope="module")
def ddp() -> list[dict[str, Any]]:
    return _values(spawn(common.train_ddp, WORLD, EPOCHS))


@pytest.mark.distributed
@pytest.mark.parametrize("script", [oss_sharded_ddp, fsdp_script])
def test_ported_script_trains_like_plain_ddp(script: Any, ddp: list[dict[str, Any]]) -> None:
    common.check_against_ddp(script.__name__, _values(spawn(script.train, WORLD, EPOCHS)), ddp)


@pytest.mark.distributed
def test_oss_with_plain_ddp_as_fairscale_allows(ddp: list[dict[str, Any]]) -> None:
    common.check_against_ddp(
        "OSS + DDP", _values(spawn(oss_sharded_ddp.train, WORLD, EPOCHS, True)), ddp
    )


@pytest.mark.distributed
def test_sharded_grad_scaler_under_autocast_and_an_overflow_on_one_rank() -> None:
    # one training per job: a second process group in one process (init, destroy, init) hung FSDP2 jobs at random
    amp = _values(spawn(grad_scaler_script.train, WORLD, EPOCHS, timeout=TIMEOUT))
    overflow = _values(spawn(grad_scaler_script.train, WORLD, 1, True, timeout=TIMEOUT))
    ddp_amp = _values(
        spawn(common.train_ddp, WORLD, EPOCHS, torch.optim.SGD, True, timeout=TIMEOUT)
    )
    results = [{"amp": a, "overflow": o, "ddp_amp": d} for a, o, d in zip(amp, overflow, ddp_amp)]
    common.check_against_ddp(
        "ShardedGradScaler",
        [r["amp"] for r in results],
        [r["ddp_amp"] for r in results],
        rtol=1e-3,
        atol=1e-4,
    )
    # rank 1 alone overflowed in the first step: both ranks skipped it and halved the scale
    for r in results:
        assert r["overflow"]["scales"][0] == 2.0**15 and r["overflow"]["scales"][1] == 2.0**15
    assert results[0]["overflow"]["state"].keys() == results[1]["overflow"]["state"].keys()
    for key, value in results[0]["overflow"]["state"].items():
        torch.testing.assert_close(results[1]["overflow"]["state"][key], value, rtol=0, atol=0)


@pytest.mark.distributed
def test_auto_wrapped_transformer_keeps_fairscales_assertions_and_trains_like_ddp() -> None:
    wrapping = _values(spawn(auto_wrap_script.check_wrapping, WORLD, timeout=TIMEOUT))
    fsdp = _values(spawn(auto_wrap_script.train, WORLD, True, timeout=TIMEOUT))
    ddp = _values(spawn(auto_wrap_script.train, WORLD, False, timeout=TIMEOUT))
    results = [{"wrapping": w, "fsdp": f, "ddp": d} for w, f, d in zip(wrapping, fsdp, ddp)]
    wrapped = results[0]["wrapping"]["wrapped"]
    assert "encoder.layers.0" in wrapped and "encoder.layers.0.linear1" in wrapped
    assert "encoder.layers.0.self_attn" not in wrapped and "" not in wrapped
    assert results[0]["wrapping"]["outside_context"] == "Linear"
    common.check_against_ddp(
        "auto_wrap", [r["fsdp"] for r in results], [r["ddp"] for r in results], rtol=1e-4, atol=1e-5
    )


# -- no processes: wrapping rules and refused arguments ----------------------------------------------------------


def test_wrap_is_a_no_op_outside_enable_wrap_and_merges_options_inside() -> None:
    calls = []

    def wrapper(module: nn.Module, **options: Any) -> nn.Module:
        calls.append((module, options))
        return module

    lin = nn.Linear(2, 2)
    assert wrap(lin) is lin and auto_wrap(lin) is lin and not calls
    with enable_wrap(wrapper_cls=wrapper, mixed_precision=True):
        wrap(lin, flatten_parameters=False)
        tfmr = nn.Transformer(
            d_model=64,
            nhead=4,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=256,
            batch_first=True,
        )
        assert auto_wrap(tfmr, min_num_params=auto_wrap_script.MIN_NUM_PARAMS) is tfmr
    assert calls[0] == (lin, {"mixed_precision": True, "flatten_parameters": False})
    wrapped = [m for m, _ in calls[1:]]
    layer = tfmr.encoder.layers[0]
    assert (
        layer in wrapped
        and layer.linear1 in wrapped
        and layer.self_attn not in wrapped
        and tfmr not in wrapped
    )
    with pytest.raises(ConfigError, match="enable_wrap needs wrapper_cls"):
        with enable_wrap(mixed_precision=True):
            pass


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: OSS([nn.Parameter(torch.ones(2))], broadcast_fp16=True),
            r"OSS: broadcast_fp16=True has no counterpart",
        ),
        (
            lambda: OSS([nn.Parameter(torch.ones(2))], broadcast_buffer_size=2**17),
            "broadcast_buffer_size=131072",
        ),
        (
            lambda: FullyShardedDataParallel(nn.Linear(2, 2), flatten_parameters=False),
            "flatten_parameters=False",
        ),
        (
            lambda: FullyShardedDataParallel(
                nn.Linear(2, 2), buffer_dtype=torch.float16, verbose=True
            ),
            r"buffer_dtype=torch.float16, verbose=True have no counterpart",
        ),
        (
            lambda: FullyShardedDataParallel(nn.Linear(2, 2), fp32_reduce_scatter=True),
            "needs mixed_precision=True",
        ),
        (lambda: FullyShardedDataParallel(nn.Linear(2, 2), reshard="yes"), r"reshard='yes'"),
        (lambda: ShardedDataParallel(nn.Linear(2, 2), None, reduce_fp16=True), "reduce_fp16=True"),
    ],
)
def test_arguments_without_a_torch_counterpart_are_refused_by_name(call: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()
