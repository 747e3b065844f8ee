"""The configuration and command-line reference (``docs/configuration.md``), generated from the code.

    python -m loomtrain.config_reference > docs/configuration.md

Every section of :class:`loomtrain.config.Config` becomes a heading with the section's
docstring and a table of its fields (type, default, constraints, description), all read from
the pydantic models; the commands and flags are read from the argparse parsers of
:mod:`loomtrain.cli` (``cli.PARSERS``). ``tests/unit/test_config_reference.py`` fails when the checked-in page
differs from :func:`render`, so the page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from typing import Any, Literal

from pydantic.fields import FieldInfo

from loomtrain import cli
from loomtrain.config import Config, toml_value

REGENERATE = "python -m loomtrain.config_reference > docs/configuration.md"

# pydantic keeps Field(ge=...) etc. as metadata objects with an attribute of that name.
_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def _markdown(text: str) -> str:
    """A docstring in Markdown: dedented, reST's double backticks made single."""
    return re.sub(r"``(.+?)``", r"`\1`", inspect.cleandoc(text))


def _cell(text: str) -> str:
    """``text`` fit for one cell of a Markdown table: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _literal(value: Any) -> str:
    """A value as it is written in a TOML config file (``None``: the field is left unset)."""
    return "unset" if value is None else toml_value(value)


def _type_name(annotation: Any) -> str:
    """``int``, ``float | None``, ``list[str]``; a ``Literal`` by the type of its choices."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(dict.fromkeys(type(a).__name__ for a in args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "None" if annotation is type(None) else annotation.__name__


def _choices(annotation: Any) -> list[Any]:
    """The allowed values of a ``Literal`` annotation (also inside ``X | None``), else empty."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return [c for arg in typing.get_args(annotation) for c in _choices(arg)]


def _constraints(field: FieldInfo) -> str:
    """Bounds, pattern and choices of ``field``, e.g. ``≥ 0, < 1`` or ``one of "a", "b"``."""
    parts = []
    for meta in field.metadata:
        for attr, symbol in _BOUNDS:
            bound = getattr(meta, attr, None)
            if bound is not None:
                parts.append(f"{symbol} {_literal(bound)}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            parts.append(f"matches `{pattern}`")
    choices = _choices(field.annotation)
    if choices:
        parts.append("one of " + ", ".join(f"`{_literal(c)}`" for c in choices))
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    return _literal(field.get_default(call_default_factory=True))


def _section(name: str, section: type) -> list[str]:
    lines = [f"## `[{name}]`", "", _markdown(section.__doc__ or ""), ""]
    lines += ["| field | type | default | constraints | description |", "| --- | --- | --- | --- | --- |"]
    for key, field in section.model_fields.items():
        cells = [
            f"`{name}.{key}`",
            f"`{_type_name(field.annotation)}`",
            f"`{_default(field)}`",
            _constraints(field),
            field.description or "",
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def _flag_value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "(switch)"
    return getattr(action.type, "__name__", "str") if action.type is not None else "str"


def _flag_default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default is None:
        return ""
    return f"`{action.default!r}`"


def _command(name: str) -> list[str]:
    parser = cli.PARSERS[name]()
    lines = [f"### `loomtrain {name}`", "", parser.description or "", ""]
    lines += ["| argument | value | default | meaning |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
        cells = [names, _flag_value(action), _flag_default(action), action.help or "—"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines + [""]


def render() -> str:
    """The whole reference page, in Markdown."""
    lines = [
        "# Configuration and command-line reference",
        "",
        f"Generated from `loomtrain/config.py` and `loomtrain/cli.py` by `{REGENERATE}`; "
        "edit the code, not this page (a unit test compares the two).",
        "",
        "A config file is TOML with one table per section below; every field has a default, so a file "
        "names only what it changes. On the command line, `--section.field=value` overrides a field "
        "(the value is read as a TOML literal, else kept as a string). Values are checked before any "
        "process starts: a bad one stops the launch with one `error:` line naming the field, exit status 2. "
        "Checks that involve several fields (divisibility of heads and batches, pipeline stages, "
        "options that only apply to one method) are listed with the sections' descriptions and in "
        "`Config`'s validators.",
        "",
        "```toml",
        "# configs/my_run.toml; then: loomtrain train --config configs/my_run.toml --training.lr=3e-4",
        "[run]",
        'name = "my_run"',
        "[training]",
        "steps = 500",
        "```",
        "",
    ]
    for name, field in Config.model_fields.items():
        lines += _section(name, field.annotation)
    lines += ["## Commands", "", f"`loomtrain {{{','.join(cli.COMMANDS)}}} ...`", ""]
    for name in cli.COMMANDS:
        lines += _command(name)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
