"""The generic JSON reader (fxpipe.schema) and the JSON writer/version check (fxpipe.jsonio)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from fxpipe.errors import FxpipeError, ProfileError
from fxpipe.jsonio import check_schema_version, dump_json
from fxpipe.schema import NonNegFloat, NonNegInt, PositiveInt, find_non_finite, read_dataclass


@dataclass(frozen=True)
class Leaf:
    size: NonNegInt
    label: str | None = None

    def __post_init__(self) -> None:
        if self.label == "forbidden":
            raise ProfileError("the label 'forbidden' is reserved")


@dataclass(frozen=True)
class Root:
    count: PositiveInt
    ratio: NonNegFloat
    flag: bool
    leaves: tuple[Leaf, ...] = ()
    sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pair: tuple[int, str] | None = None


GOOD = {
    "count": 2,
    "ratio": 0.5,
    "flag": True,
    "leaves": [{"size": 3}, {"size": 4, "label": "x"}],
    "sizes": {"a": [1, 2]},
    "pair": [1, "one"],
    "unknown": "ignored",
}


def test_reads_nested_values_into_dataclasses_and_tuples() -> None:
    got = read_dataclass(Root, GOOD, "root", ProfileError)
    assert got == Root(
        count=2,
        ratio=0.5,
        flag=True,
        leaves=(Leaf(3), Leaf(4, "x")),
        sizes={"a": (1, 2)},
        pair=(1, "one"),
    )
    assert isinstance(read_dataclass(Root, dict(GOOD, ratio=1), "root", ProfileError).ratio, float)
    assert (
        read_dataclass(Root, dict(GOOD, count=3.0), "root", ProfileError).count == 3
    )  # an integral number


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"count": "2"}, "root count: expected an integer, got '2'"),
        ({"count": 0}, "root count: expected an integer >= 1, got 0"),
        ({"count": 2.5}, "root count: expected an integer, got 2.5"),
        ({"count": True}, "root count: expected an integer, got true"),
        ({"ratio": "fast"}, "root ratio: expected a number, got 'fast'"),
        ({"ratio": math.nan}, "root ratio: expected a finite number, got NaN"),
        ({"ratio": -math.inf}, "root ratio: expected a finite number, got -Infinity"),
        ({"ratio": -0.5}, "root ratio: expected a number >= 0, got -0.5"),
        ({"flag": 1}, "root flag: expected true or false, got 1"),
        ({"leaves": None}, "root leaves: expected a list, got null"),
        ({"leaves": {"size": 1}}, "root leaves: expected a list, got an object"),
        ({"leaves": [{"size": 1}, 7]}, "root leaves[1]: expected an object, got 7"),
        ({"leaves": [{"size": -1}]}, "root leaves[0].size: expected an integer >= 0, got -1"),
        ({"leaves": [{"label": "x"}]}, "root leaves[0]: missing the field 'size'"),
        ({"leaves": [{"size": 1, "label": 5}]}, "root leaves[0].label: expected a string, got 5"),
        (
            {"leaves": [{"size": 1, "label": "forbidden"}]},
            "root leaves[0]: the label 'forbidden' is reserved",
        ),
        ({"sizes": {"a": [1, "b"]}}, "root sizes['a'][1]: expected an integer, got 'b'"),
        ({"pair": [1]}, "root pair: expected a list of 2 items, got 1"),
    ],
)
def test_each_wrong_value_is_one_line_naming_its_path(change: dict, message: str) -> None:
    with pytest.raises(ProfileError) as info:
        read_dataclass(Root, {**GOOD, **change}, "root", ProfileError)
    assert str(info.value) == message


def test_missing_top_level_field_and_a_non_object() -> None:
    with pytest.raises(ProfileError, match="^root: missing the field 'count'$"):
        read_dataclass(Root, {"ratio": 1.0, "flag": False}, "root", ProfileError)
    with pytest.raises(ProfileError, match="^root: expected an object, got a list$"):
        read_dataclass(Root, [], "root", ProfileError)


def test_find_non_finite_names_the_path() -> None:
    assert find_non_finite({"a": [1.0, {"b": math.inf}]}) == "a[1].b"
    assert find_non_finite({"a": [1.0, "nan"]}) is None


def test_dump_json_refuses_nan_and_infinity(tmp_path) -> None:
    path = tmp_path / "x.json"
    with pytest.raises(ProfileError, match=r"^profile units\[0\].fwd_ms is not a finite number"):
        dump_json({"units": [{"fwd_ms": math.nan}]}, path, what="profile", error=ProfileError)
    assert not path.exists()
    assert dump_json({"a": [1, 2.5]}) == '{\n "a": [\n  1,\n  2.5\n ]\n}'


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("1", 'plan schema_version must be an integer such as 2, got "1"; re-plan'),
        (True, "plan schema_version must be an integer such as 2, got true; re-plan"),
        (
            3,
            "plan schema version 3 is newer than this fxpipe understands (2); upgrade fxpipe, or re-plan",
        ),
        (0, "plan schema version 0 is older than this fxpipe reads (versions 1 to 2); re-plan"),
    ],
)
def test_schema_version_messages(version: object, message: str) -> None:
    with pytest.raises(FxpipeError) as info:
        check_schema_version(
            {"schema_version": version}, 2, "plan", FxpipeError, oldest=1, remedy="re-plan"
        )
    assert str(info.value) == message
    assert check_schema_version({}, 2, "plan", FxpipeError) == 2
