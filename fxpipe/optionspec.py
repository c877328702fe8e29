"""Options declared once: a dataclass field carries its flag, help, choices and seed-config key.

Note [options declared once]: every option a user gives fxpipe is a field of one frozen
dataclass per concern: ``PlanOptions`` and ``ClusterOptions`` (what ``fxpipe plan/partition``
price and search, ``fxpipe.partitioner``), ``RunOptions`` with its groups
``DataParallelOptions`` and ``TrainingOptions`` (what a run is told, ``fxpipe.runtime``). The
data-parallel fields that the cost model prices are declared on ``CostModel`` (the lowest
layer that reads them) and taken over with ``same_as``, so their help and choices cannot
drift apart either. Each field's ``option(...)`` says its flag, help, metavar, choices and
seed-config key, and everything else is derived from it:

* ``add_arguments`` adds the argparse flags with their help (``fxpipe <verb> --help``, the
  worker's parser), ``namespace_values`` / ``from_namespace`` read them back;
* ``Options.to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` are the JSON form (the
  ``--options`` file that ``fxpipe run`` writes for its workers), nested groups as objects,
  unknown keys refused;
* ``seed_keys`` names the keys of ``fxpipe.init``'s config that a group accepts
  (``fxpipe.smp.config``).

Validation is each class's ``__post_init__`` (the one place), so a value is checked alike
whether it came from a flag, a JSON file or the seed config. A check that belongs to the
option itself (its choices, its range) is declared with it (``option(check=...)``) and runs
in ``check_options(self)``, so a class that takes the option with ``same_as`` refuses a bad
value with the same line (``CostModel`` and ``DataParallelOptions``). Nothing here imports torch:
the CLI builds every verb's parser at start-up.

>>> @dataclass(frozen=True, kw_only=True)
... class Demo(Options):
...     rank: int = option(1, help="PowerSGD rank", metavar="K", seed_key="rank_key")
...     hook: str = option("allreduce", help="communication hook: %(choices)s", choices=("allreduce", "fp16"))
>>> parser = argparse.ArgumentParser()
>>> add_arguments(parser, Demo)
>>> from_namespace(Demo, parser.parse_args(["--rank", "2"]))
Demo(rank=2, hook='allreduce')
>>> Demo.from_dict(Demo(hook="fp16").to_dict()), seed_keys(Demo)
(Demo(rank=1, hook='fp16'), {'rank_key': 'rank'})
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from fxpipe.errors import ConfigError
from fxpipe.jsonio import check_schema_version, dump_json, load_json, refuse_unknown_fields

__all__ = [
    "Option",
    "Switch",
    "Options",
    "option",
    "group",
    "same_as",
    "add_arguments",
    "namespace_values",
    "from_namespace",
    "groups_of",
    "seed_keys",
    "choices_of",
    "flags_of",
    "option_of",
    "check_options",
    "declarations_of",
]

T = TypeVar("T")
_OPTION = "fxpipe.option"
_GROUP = "fxpipe.group"


@dataclass(frozen=True)
class Switch:
    """A flag without a value that sets the option to ``value`` (e.g. an older spelling of one choice)."""

    flag: str
    value: Any
    help: str


@dataclass(frozen=True)
class Option:
    """What a field's ``option(...)`` declares besides its default (see ``option``)."""

    help: str
    flag: str | bool = True
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    parse_choices: bool = True
    parse: Callable[[str], Any] | None = None
    none_means: str | None = None
    default_text: str | None = None
    seed_key: str | None = None
    switches: tuple[Switch, ...] = ()
    repeat: bool = False
    check: Callable[[Any], str | None] | None = None
    # "Class.field" of the declaration ``same_as`` took this one from (None: declared here)
    origin: str | None = field(default=None, compare=False)

    def flag_for(self, name: str) -> str | None:
        """The command-line flag of the field ``name``: its own, ``--the-name``, or None."""
        if self.flag is False:
            return None
        return self.flag if isinstance(self.flag, str) else "--" + name.replace("_", "-")


def option(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Any = MISSING,
    flag: str | bool = True,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    choices: tuple[Any, ...] | None = None,
    parse_choices: bool = True,
    parse: Callable[[str], Any] | None = None,
    none_means: str | None = None,
    default_text: str | None = None,
    seed_key: str | None = None,
    switches: tuple[Switch, ...] = (),
    repeat: bool = False,
    check: Callable[[Any], str | None] | None = None,
) -> Any:
    """A dataclass field that is an option: its ``default`` and how users give it.

    ``help`` is the flag's help (``%(choices)s`` expands); ``flag`` the command-line flag
    (``True``: ``--`` and the field name with dashes, ``False``: none, JSON and Python only),
    ``aliases`` more spellings of it; ``metavar``, ``choices`` and ``parse`` (the function
    that reads the flag's text; default: the field's int or float type) as argparse has them.
    ``parse_choices=False`` leaves a value outside ``choices`` to ``__post_init__`` (one error
    line naming it, instead of argparse's usage message). The help ends with the default, as
    ``default_text``, or ``none_means`` for a ``None`` default. ``seed_key``: the key of
    ``fxpipe.init``'s config that sets it. ``switches``: flags without a value that set it to
    one value. ``repeat``: a flag given once per item of a tuple (argparse's ``append``).
    ``check``: the option's own validation, a function of the value that returns the error
    line for a bad one and None for a good one (run by ``check_options``).
    """
    spec = Option(
        help=help,
        flag=flag,
        aliases=aliases,
        metavar=metavar,
        choices=choices,
        parse_choices=parse_choices,
        parse=parse,
        none_means=none_means,
        default_text=default_text,
        seed_key=seed_key,
        switches=switches,
        repeat=repeat,
        check=check,
    )
    return field(default=default, default_factory=default_factory, metadata={_OPTION: spec})


def group(cls: type) -> Any:
    """A field holding a nested options dataclass (``RunOptions.data_parallel``): its flags are
    added with the parent's, under dotted names, and its JSON is a nested object."""
    return field(default_factory=cls, metadata={_GROUP: cls})


def same_as(cls: type, name: str, *, default: Any = MISSING, **changes: Any) -> Any:
    """A new field declared as ``cls``'s field ``name`` (default, help, choices, check, ...),
    with ``changes`` to its ``Option`` (e.g. ``seed_key``) and another ``default`` where the
    verb has its own: one declaration for an option that two dataclasses hold, such as the
    data-parallel fields of ``CostModel`` and ``DataParallelOptions``, or ``--schedule`` of
    ``fxpipe plan`` (which adds ``auto``) and ``fxpipe run`` (the build's by default)."""
    source = next(f for f in dataclasses.fields(cls) if f.name == name)
    declared = source.metadata[_OPTION]
    origin = declared.origin or f"{cls.__qualname__}.{name}"
    spec = dataclasses.replace(declared, origin=origin, **changes)
    if default is not MISSING:
        return field(default=default, metadata={_OPTION: spec})
    return field(
        default=source.default, default_factory=source.default_factory, metadata={_OPTION: spec}
    )


def option_of(cls: type, name: str) -> Option:
    """The ``Option`` of ``cls``'s field ``name``."""
    return next(f.metadata[_OPTION] for f in dataclasses.fields(cls) if f.name == name)


def check_options(options: Any) -> None:
    """Run the declared ``check`` of every option field of the dataclass instance ``options``
    (in field order; from its ``__post_init__``) and raise ``ConfigError`` with the first
    error line."""
    for f in dataclasses.fields(options):
        spec = f.metadata.get(_OPTION)
        if spec is not None and spec.check is not None:
            problem = spec.check(getattr(options, f.name))
            if problem is not None:
                raise ConfigError(problem)


def choices_of(cls: type, name: str) -> tuple[Any, ...]:
    """The declared choices of ``cls``'s field ``name`` (for validation messages)."""
    choices = option_of(cls, name).choices
    assert choices is not None, f"{cls.__name__}.{name} declares no choices"
    return choices


class Options:
    """The JSON form of an options dataclass, from its fields: nested groups are objects,
    tuples lists; ``from_dict`` refuses unknown keys (``what`` names the options in that
    message) and leaves every other check to the class's ``__post_init__``."""

    what: ClassVar[str] = "options"
    json_schema_version: ClassVar[int | None] = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (with a ``schema_version`` where the class has one)."""
        out: dict[str, Any] = {}
        if self.json_schema_version is not None:
            out["schema_version"] = self.json_schema_version
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = (
                value.to_dict()
                if _GROUP in f.metadata
                else list(value)
                if isinstance(value, tuple)
                else value
            )
        return out

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        """Inverse of ``to_dict``; missing keys take their defaults, unknown keys are refused."""
        values = dict(data)
        version = getattr(cls, "json_schema_version", None)
        if version is not None:
            check_schema_version(values, version, getattr(cls, "what"), ConfigError)
            values.pop("schema_version", None)
        refuse_unknown_fields(cls, values, getattr(cls, "what"), ConfigError)
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if _GROUP in f.metadata and isinstance(values.get(f.name), dict):
                values[f.name] = f.metadata[_GROUP].from_dict(values[f.name])
        return cls(**values)

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self.to_dict(), path, what=self.what, error=ConfigError)

    @classmethod
    def from_json(cls: type[T], source: str | Path) -> T:
        """Read options from a JSON file or JSON text."""
        return typing.cast(Any, cls).from_dict(load_json(source, getattr(cls, "what"), ConfigError))


# -- the command-line form -----------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _scalar(hint: Any) -> Any:
    """``int | None`` -> ``int``; ``tuple[str, ...]`` -> ``tuple``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    return typing.get_origin(hint) or hint


def _options(
    cls: type, prefix: str = ""
) -> Iterator[tuple[str, dataclasses.Field[Any], Option, Any]]:
    """``(dotted path, field, Option, scalar type)`` of every option of ``cls``, its groups' included."""
    for f in dataclasses.fields(cls):
        if _GROUP in f.metadata:
            yield from _options(f.metadata[_GROUP], f"{prefix}{f.name}.")
        elif _OPTION in f.metadata:
            yield f"{prefix}{f.name}", f, f.metadata[_OPTION], _scalar(_hints(cls)[f.name])


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _shown(spec: Option, default: Any) -> str | None:
    """The default as the help ends with it, or None to say nothing."""
    if spec.default_text is not None:
        return spec.default_text
    if default is None:
        return spec.none_means
    if isinstance(default, bool):
        return None
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, tuple):
        return ",".join(str(v) for v in default) if default else None
    return str(default)


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    title: str | None = None,
    only: tuple[str, ...] | None = None,
    suppress: bool = False,
) -> None:
    """Add the flags of ``cls``'s options (its groups' too) to ``parser``, in a group ``title``
    if given, or only those whose dotted path is in ``only``.

    Each flag's ``dest`` is the option's dotted path (``data_parallel.comm_hook``). With
    ``suppress`` a flag left out is absent from the namespace (the default lives in the
    dataclass, so flags given beside a JSON file override only what they name); else the
    namespace holds the dataclass's default.
    """
    target = parser.add_argument_group(title) if title is not None else parser
    for path, f, spec, kind in _options(cls):
        flag = spec.flag_for(f.name)
        if flag is None or (only is not None and path not in only):
            continue
        default = _default(f)
        shown = _shown(spec, default)
        text = spec.help if shown is None else f"{spec.help} (default: {shown.replace('%', '%%')})"
        missing = argparse.SUPPRESS if suppress else default
        if kind is bool:
            if suppress:
                target.add_argument(
                    flag,
                    *spec.aliases,
                    dest=path,
                    action="store_const",
                    const=True,
                    default=missing,
                    help=text,
                )
            else:
                target.add_argument(flag, *spec.aliases, dest=path, action="store_true", help=text)
        elif spec.repeat:
            target.add_argument(
                flag,
                *spec.aliases,
                dest=path,
                action="append",
                default=missing if suppress else list(default),
                metavar=spec.metavar,
                help=text,
            )
        else:
            parse = spec.parse or (
                kind if kind in (int, float) else None
            )  # None: the text as it is
            typed: dict[str, Any] = {"type": parse} if parse is not None else {}
            target.add_argument(
                flag,
                *spec.aliases,
                dest=path,
                metavar=spec.metavar,
                default=missing,
                help=text,
                choices=spec.choices if spec.parse_choices else None,
                **typed,
            )
        for switch in spec.switches:
            target.add_argument(
                switch.flag,
                dest=path,
                action="store_const",
                const=switch.value,
                default=argparse.SUPPRESS,
                help=switch.help,
            )


def namespace_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values ``add_arguments``' flags put in ``args``, as ``from_dict`` data: nested
    groups as dicts, repeated flags as tuples; flags absent from ``args`` are left out."""
    given = vars(args)
    data: dict[str, Any] = {}
    for path, _, _, kind in _options(cls):
        if path not in given:
            continue
        *groups, name = path.split(".")
        target = data
        for part in groups:
            target = target.setdefault(part, {})
        value = given[path]
        target[name] = tuple(value) if kind is tuple and isinstance(value, list) else value
    return data


def from_namespace(cls: type[T], args: argparse.Namespace) -> T:
    """The ``cls`` that ``add_arguments``' flags in ``args`` describe, validated."""
    return typing.cast(Any, cls).from_dict(namespace_values(cls, args))


def groups_of(cls: type) -> dict[str, type]:
    """``{field name: options class}`` of ``cls``'s nested groups (``group(...)`` fields)."""
    return {f.name: f.metadata[_GROUP] for f in dataclasses.fields(cls) if _GROUP in f.metadata}


def seed_keys(cls: type) -> dict[str, str]:
    """``{seed-config key: field name}`` of ``cls``'s options that ``fxpipe.init``'s config sets."""
    return {
        spec.seed_key: f.name
        for f in dataclasses.fields(cls)
        if (spec := f.metadata.get(_OPTION)) is not None and spec.seed_key is not None
    }


def declarations_of(cls: type) -> dict[str, str]:
    """``{flag: "Class.field" of the declaration it comes from}`` for ``cls``'s flags (its
    groups' too): the field's own, or the one ``same_as`` took it from."""
    out: dict[str, str] = {}
    for path, f, spec, _ in _options(cls):
        flag = spec.flag_for(f.name)
        if flag is not None:
            owner = cls if "." not in path else _owner(cls, path)
            out[flag] = spec.origin or f"{owner.__qualname__}.{f.name}"
    return out


def _owner(cls: type, path: str) -> type:
    """The options class that holds the field at dotted ``path`` of ``cls``."""
    for part in path.split(".")[:-1]:
        cls = groups_of(cls)[part]
    return cls


def flags_of(cls: type) -> list[str]:
    """Every flag that ``add_arguments`` adds for ``cls`` (aliases and switches included)."""
    out: list[str] = []
    for _, f, spec, _ in _options(cls):
        flag = spec.flag_for(f.name)
        if flag is not None:
            out += [flag, *spec.aliases, *(s.flag for s in spec.switches)]
    return out
