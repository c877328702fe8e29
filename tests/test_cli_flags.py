"""Every verb keeps its flags: the set of flags per verb, with default, choices, action and
type, pinned in ``cli_flags.json`` (taken from the parsers before the options were declared
once as dataclasses, fxpipe.optionspec). Help texts may change; what a flag means may not.

Regenerate on purpose (a flag added or changed) with ``python tests/test_cli_flags.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).with_name("cli_flags.json")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _flags(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    out = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        key = " ".join(action.option_strings) or action.dest
        out[key] = {
            "dest": action.dest,
            "default": _jsonable(action.default),
            "choices": _jsonable(list(action.choices)) if action.choices is not None else None,
            "action": type(action).__name__,
            "const": _jsonable(action.const),
            "type": getattr(action.type, "__name__", None) if action.type is not None else None,
        }
    return out


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """``fxpipe``'s parser, each verb's and the worker's."""
    from fxpipe.cli import build_parser
    from fxpipe.runtime.launch import worker

    parser = build_parser()
    parsers = {"fxpipe": parser}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parsers.update(sub.choices)
    for verb, verb_parser in sub.choices.items():  # a verb of verbs: `fxpipe checkpoint convert`
        for action in verb_parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.update({f"{verb} {tool}": p for tool, p in action.choices.items()})
    captured: dict[str, argparse.ArgumentParser] = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        captured["worker"] = self
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        worker.parse_args(["build"])
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    parsers["worker"] = captured["worker"]
    return parsers


def current() -> dict[str, dict[str, dict[str, Any]]]:
    return {verb: _flags(parser) for verb, parser in _parsers().items()}


def _reading(spec: dict[str, Any]) -> dict[str, Any]:
    """What a user sees of a flag: ``type=str`` and no type read it alike, and ``dest`` is the
    namespace's name for it, the parser's own business (``--leaf`` fills ``leaves``)."""
    return {
        **{k: v for k, v in spec.items() if k != "dest"},
        "type": None if spec["type"] == "str" else spec["type"],
    }


def test_every_verb_keeps_its_flags_and_defaults() -> None:
    expected = {
        verb: {flag: _reading(spec) for flag, spec in flags.items()}
        for verb, flags in json.loads(SNAPSHOT.read_text()).items()
    }
    got = {
        verb: {flag: _reading(spec) for flag, spec in flags.items()}
        for verb, flags in current().items()
    }
    assert set(got) == set(expected)
    for verb in expected:
        assert set(got[verb]) == set(expected[verb]), verb
        for flag, spec in expected[verb].items():
            assert got[verb][flag] == spec, (verb, flag)


def test_every_flag_has_help() -> None:
    for verb, parser in _parsers().items():
        parser.format_help()  # every %(choices)s expands
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, (verb, action.option_strings)


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
