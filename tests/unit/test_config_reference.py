"""The generated configuration reference (docs/configuration.md): each test names the bug it would catch."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomtrain import cli, config_reference
from loomtrain.config import Config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SECTIONS = list(Config.model_fields.items())


def test_checked_in_page_equals_render():
    """Catches a config field, default, constraint, description or CLI flag changed in the code
    while docs/configuration.md still shows the old one."""
    assert PAGE.is_file(), f"{PAGE} is missing; run `{config_reference.REGENERATE}`"
    assert PAGE.read_text(encoding="utf-8") == config_reference.render(), (
        f"docs/configuration.md is out of date with loomtrain/config.py or cli.py; run `{config_reference.REGENERATE}`"
    )


@pytest.mark.parametrize(("name", "section"), SECTIONS, ids=[name for name, _ in SECTIONS])
def test_every_field_has_a_description(name, section):
    """Catches a field added to a config section without `Field(..., description=...)`, which
    would appear in the reference with an empty description."""
    undescribed = [
        key for key, field in section.annotation.model_fields.items() if not (field.description or "").strip()
    ]
    assert not undescribed, f"[{name}] fields without a description: {undescribed}"


def test_every_field_and_command_is_in_the_page():
    """Catches the renderer skipping a section, a field or a subcommand (e.g. a new section
    type it cannot iterate), which comparing the page with render() alone would not notice."""
    page = config_reference.render()
    for name, section in SECTIONS:
        assert f"## `[{name}]`" in page
        for key in section.annotation.model_fields:
            assert f"| `{name}.{key}` |" in page, f"{name}.{key} is missing from the reference"
    for command in cli.COMMANDS:
        assert f"### `loomtrain {command}`" in page


def test_flags_come_from_each_commands_own_parser(capsys):
    """Catches a command that parses with another parser than the one the reference reads
    (``cli.PARSERS``): a flag added to ``loomtrain generate`` or ``report`` that the reference
    would never list, or a command without an entry."""
    assert cli.PARSERS.keys() == cli.COMMANDS.keys()
    for command, build in cli.PARSERS.items():
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        shown = capsys.readouterr().out
        assert shown == build().format_help(), command


def test_constraints_and_defaults_are_rendered_from_the_field():
    """Catches bounds, patterns, Literal choices or default factories lost on the way to the
    table (each row is built from pydantic's metadata, not written by hand)."""
    page = config_reference.render()
    row = next(line for line in page.splitlines() if line.startswith("| `data_parallel.zero_stage` |"))
    assert "`0`" in row and "≥ 0, ≤ 3" in row
    row = next(line for line in page.splitlines() if line.startswith("| `data.val_plays` |"))
    assert '`["hamlet", "the-tempest"]`' in row
    row = next(line for line in page.splitlines() if line.startswith("| `run.device` |"))
    assert 'one of `"auto"`, `"cpu"`, `"cuda"`' in row
    row = next(line for line in page.splitlines() if line.startswith("| `model.n_kv_heads` |"))
    assert "`int \\| None`" in row and "`unset`" in row
