"""The cost model's fitted constants and their provenance, read once from ``calibration.json``.

Note [calibration data]: the cost model's formulas live in the code and its numbers in
``fxpipe/calibration.json``, shipped with the package: the tracer's device presets
(``DEVICE_PRESETS`` in :mod:`fxpipe.tracer.measure.calibration`), the runtime's fixed costs per
trace device (``RUNTIME_COSTS`` in :mod:`fxpipe.partitioner.prediction`) and the link
presets (``LINK_PRESETS`` in :mod:`fxpipe.partitioner.cost`) are built from it. Each
constant carries its value, its unit and its provenance: the benchmark that measured it
(or ``none`` for an assumption), the host (a key of the file's ``hosts``), the date the
value was set and how it follows from the measurement; ``unknown`` where that is not on
record. A Note in the code says what the model assumes and why; the figures, and the
history of how they were reached, are the file's and the benchmarks' (``benchmarks/*/README.md``).
A value changes in the file, with its provenance, after the benchmark it names is rerun.
This module imports nothing but :mod:`fxpipe.errors`, so every layer may read it.

>>> values("runtime_costs", "cpu")["action_ms"]
0.04
>>> constants("device_presets", "cpu")["call_ms"].provenance.benchmark
'benchmarks/prediction/host_speed.py'
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Union

from fxpipe.errors import ConfigError

__all__ = [
    "Provenance",
    "Constant",
    "CALIBRATION_FILE",
    "CALIBRATION_SCHEMA_VERSION",
    "hosts",
    "names",
    "constants",
    "values",
    "all_constants",
]

CALIBRATION_FILE = "calibration.json"  # beside this module, in the package
CALIBRATION_SCHEMA_VERSION = 1
_SECTIONS = ("device_presets", "runtime_costs", "links")
_PROVENANCE = ("benchmark", "host", "date", "how")

Value = Union[bool, int, float]


@dataclass(frozen=True)
class Provenance:
    """Where a constant comes from (Note [calibration data])."""

    benchmark: str  # the script or method that measured it; "none" for an assumption
    host: str  # a key of the file's ``hosts``
    date: str  # when the value was set (YYYY-MM-DD), or "unknown"
    how: str  # what was measured and how the value follows from it


@dataclass(frozen=True)
class Constant:
    """One fitted or assumed constant of the cost model."""

    value: Value
    unit: str
    provenance: Provenance


Group = dict[str, Union[Constant, "Group"]]


@cache
def _document() -> dict[str, Any]:
    """The parsed and checked data file (read once per process)."""
    text = resources.files("fxpipe").joinpath(CALIBRATION_FILE).read_text(encoding="utf-8")
    doc = json.loads(text)
    if doc.get("schema_version") != CALIBRATION_SCHEMA_VERSION:
        raise ConfigError(
            f"fxpipe/{CALIBRATION_FILE} has schema version {doc.get('schema_version')!r}, this fxpipe "
            f"reads {CALIBRATION_SCHEMA_VERSION}; reinstall fxpipe"
        )
    known = doc.get("hosts", {})
    for section in _SECTIONS:
        for name, group in doc.get(section, {}).items():
            _check(group, f"{section}.{name}", known)
    return doc


def _check(group: dict[str, Any], path: str, known_hosts: dict[str, str]) -> None:
    for key, entry in group.items():
        where = f"{path}.{key}"
        if not isinstance(entry, dict):
            raise ConfigError(
                f"fxpipe/{CALIBRATION_FILE}: {where} is {entry!r}, not an entry or a group"
            )
        if "value" not in entry:
            _check(entry, where, known_hosts)
            continue
        prov = entry.get("provenance", {})
        missing = [k for k in ("unit", "provenance") if k not in entry] + [
            k for k in _PROVENANCE if not prov.get(k)
        ]
        if missing or not isinstance(entry["value"], (bool, int, float)):
            raise ConfigError(
                f"fxpipe/{CALIBRATION_FILE}: {where} lacks {', '.join(missing) or 'a numeric value'}"
            )
        if prov["host"] not in known_hosts:
            raise ConfigError(
                f"fxpipe/{CALIBRATION_FILE}: {where} names host {prov['host']!r}, "
                f"not one of {sorted(known_hosts)}"
            )


def _constants(group: dict[str, Any]) -> Group:
    out: Group = {}
    for key, entry in group.items():
        if "value" in entry:
            out[key] = Constant(
                entry["value"],
                entry["unit"],
                Provenance(**{k: entry["provenance"][k] for k in _PROVENANCE}),
            )
        else:
            out[key] = _constants(entry)
    return out


def hosts() -> dict[str, str]:
    """The hosts the constants were measured on: key -> description."""
    return dict(_document()["hosts"])


def names(section: str) -> tuple[str, ...]:
    """The presets of ``section`` (``"device_presets"``, ``"runtime_costs"`` or ``"links"``), in file order."""
    return tuple(_section(section))


def constants(section: str, name: str) -> Group:
    """The constants of one preset, e.g. ``constants("runtime_costs", "cpu")``; a group of
    constants (``op_extra_s``) is a dict of its own."""
    preset = _section(section).get(name)
    if preset is None:
        raise ConfigError(
            f"fxpipe/{CALIBRATION_FILE} has no {section} entry {name!r}; "
            f"it has {sorted(_section(section))}"
        )
    return _constants(preset)


def values(section: str, name: str) -> dict[str, Any]:
    """The values alone of ``constants(section, name)``, groups as dicts (in file order)."""

    def plain(group: Group) -> dict[str, Any]:
        return {k: c.value if isinstance(c, Constant) else plain(c) for k, c in group.items()}

    return plain(constants(section, name))


def all_constants() -> Iterator[tuple[str, Constant]]:
    """Every constant in the file with its dotted path, e.g. ``runtime_costs.cpu.action_ms``."""

    def walk(group: Group, path: str) -> Iterator[tuple[str, Constant]]:
        for key, c in group.items():
            yield from (
                ((f"{path}.{key}", c),) if isinstance(c, Constant) else walk(c, f"{path}.{key}")
            )

    for section in _SECTIONS:
        for name in names(section):
            yield from walk(constants(section, name), f"{section}.{name}")


def _section(section: str) -> dict[str, Any]:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown calibration section {section!r}; one of {list(_SECTIONS)}")
    return _document()[section]
