"""Construction is observed only inside ``partition`` blocks and recordings (Note [observing construction])."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch.nn as nn

from fxpipe.tracer import build_model_recorded, partition
from fxpipe.tracer.construct.construction import observe_construction
from fxpipe.tracer.construct.pins import pin_of

# nn.Module.__init__ as it was before fxpipe observed anything: torch itself may have patched it
# earlier in the process (torch._dynamo's install_generation_tagging_init, once anything was
# compiled), and fxpipe must restore exactly what it found
ORIGINAL_INIT: list[Any] = []


def _untouched() -> bool:
    return (
        "__new__" not in nn.Module.__dict__ and nn.Module.__dict__["__init__"] is ORIGINAL_INIT[0]
    )


class _Scaled(nn.Module):
    def __init__(self, width: int, scale: float = 1.0, *, bias: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width, bias=bias)
        self.scale = scale


class _Inherits(_Scaled):
    pass


class _Variadic(nn.Module):
    def __init__(self, first: int, *rest: int, **options: Any) -> None:
        super().__init__()
        self.sizes = (first, *rest)
        self.options = options


class _NoInit(nn.Module):
    def forward(self, x: Any) -> Any:
        return x


def _logged(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class _Decorated(nn.Module):
    @_logged
    def __init__(self, width: int, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Scaled(width) for _ in range(depth))


class _Outer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = _Scaled(width * 2, 0.5)
        with partition(1):
            self.pinned = _Scaled(width)


def _record(factory: Any) -> dict[str, Any]:
    return build_model_recorded(factory)[1].ctor_args


def test_nn_module_is_untouched_outside_blocks_and_recordings() -> None:
    ORIGINAL_INIT[:] = [nn.Module.__dict__["__init__"]]
    assert _untouched()
    with partition(0):
        assert not _untouched()  # observed only inside
        with partition(1):
            pass
        assert not _untouched()
    assert _untouched()
    model, record = build_model_recorded(lambda: _Outer(4))
    assert _untouched() and record.pins["pinned"] == 1
    with pytest.raises(RuntimeError, match="boom"):
        with observe_construction(lambda m, a: None, arguments=True):
            raise RuntimeError("boom")
    assert _untouched()
    # subclasses with arguments construct normally afterwards
    assert _Scaled(3, 2.0, bias=False).lin.bias is None and _Inherits(5).lin.in_features == 5
    assert nn.Linear(2, 3).weight.shape == (3, 2)


def test_constructor_arguments_are_those_of_the_call() -> None:
    args = _record(
        lambda: nn.Sequential(
            _Scaled(4),
            _Scaled(4, 0.5, bias=False),
            _Inherits(6, 2.0),
            _Variadic(1, 2, 3, mode="x"),
            _NoInit(),
            _Decorated(3),
        )
    )
    assert args["0"] == ((4,), {})  # trailing defaults left out
    assert args["1"] == ((4, 0.5), {"bias": False})
    assert args["2"] == ((6, 2.0), {})  # the inherited __init__'s arguments
    assert args["3"] == ((1, 2, 3), {"mode": "x"})
    assert args["4"] == ((), {})
    assert args["5"] == ((3,), {}) and args["5.blocks.1"] == ((3,), {})  # through a decorator
    assert args["1.lin"] == ((4, 4, False), {})  # bound by position, as its signature allows
    assert _Scaled(*args["1"][0], **args["1"][1]).scale == 0.5  # they rebuild the module


def test_nested_construction_keeps_each_modules_own_arguments_and_pins() -> None:
    model, record = build_model_recorded(lambda: _Outer(4))
    assert record.ctor_args[""] == ((4,), {})
    assert record.ctor_args["inner"] == ((8, 0.5), {})
    assert record.ctor_args["pinned"] == ((4,), {})
    assert (
        pin_of(model.pinned) == 1 and pin_of(model.pinned.lin) == 1 and pin_of(model.inner) is None
    )
    assert record.pins == {"pinned": 1, "pinned.lin": 1}
