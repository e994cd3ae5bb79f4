"""``--help`` laid out for an 80-column terminal: option names never cut, values never split.

Typer's own layout gives every option five columns (long and short names, their negations, the
type with every choice spelled out) and, when they do not fit, cuts the names (``--max-num-batc…``).
Here an option is two cells: its names with a short metavar (never wrapped; a ``--x / --no-x`` pair
too wide for the column goes on two lines) and its help, which wraps between words only: the
default and the choices are kept whole.
"""

from __future__ import annotations

import enum
import inspect
import typing
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

NAME_WIDTH = 26  # the widest name cell kept on one line ("--max-num-batched-tokens N")
METAVARS = {int: "N", float: "X", str: "TEXT", Path: "PATH"}


class HelpCommand(TyperCommand):
    """A Typer command whose ``--help`` is `render_help`'s."""

    def format_help(self, ctx, formatter) -> None:
        render_help(self, ctx, Console(highlight=False))


class HelpGroup(TyperGroup):
    """A Typer group (``pagedinfer --help``) laid out as `render_help` lays out a command, with its
    commands after the options: Typer's own layout shows a flag as taking a value (``--version <bool>``)."""

    def format_help(self, ctx, formatter) -> None:
        console = Console(highlight=False)
        render_help(self, ctx, console)
        _render_commands(self, ctx, console)


def _render_commands(group, ctx, console: Console) -> None:
    """The Commands panel: each visible command with the first paragraph of its help."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold cyan")
    grid.add_column(overflow="fold")
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is not None and not command.hidden:
            first = inspect.cleandoc(command.help or "").split("\n\n")[0]
            grid.add_row(name, Text.from_markup(" ".join(first.split())))
    console.print(Panel(grid, title="Commands", title_align="left", border_style="dim"))


def render_help(command, ctx, console: Console) -> None:
    """Usage, the command's docstring, then one panel per help group of its visible parameters."""
    console.print(
        Text.assemble(" ", ("Usage:", "yellow"), " ", command.get_usage(ctx).removeprefix("Usage: "))
    )
    paragraphs = [
        " ".join(p.split()) for p in inspect.cleandoc(command.help or "").split("\n\n") if p.strip()
    ]
    for i, paragraph in enumerate(paragraphs):
        console.print()
        console.print(Text.from_markup(paragraph, style="bold" if i == 0 else "dim"))
    console.print()
    panels: dict[str, list] = defaultdict(list)
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        default_panel = "Arguments" if param.param_type_name == "argument" else "Options"
        panels[getattr(param, "rich_help_panel", None) or default_panel].append(param)
    names = {title: [_names(p) for p in params] for title, params in panels.items()}
    width = max(len(line) for cells in names.values() for cell in cells for line in cell.split("\n"))
    help_width = console.width - 4 - width - 2  # the panel's borders and padding, the gap between the cells
    for title, params in panels.items():
        cells = [(name, _help(p, console, help_width)) for name, p in zip(names[title], params, strict=True)]
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, style="bold cyan", width=width)
        grid.add_column(overflow="fold")
        for name, help_text in cells:
            grid.add_row(name, help_text)
        console.print(Panel(grid, title=title, title_align="left", border_style="dim"))


def _names(param) -> str:
    """``--kv-cache-memory TEXT``, ``--model, -m TEXT``, ``--report / --no-report``, ``PROMPTS.jsonl``."""
    if param.param_type_name == "argument":
        return param.metavar or param.name.upper()
    text = ", ".join(param.opts)
    if not param.is_flag:
        text += " " + (param.metavar or _value_kind(param)[0])
    if param.secondary_opts:
        pair = f"{text} / {', '.join(param.secondary_opts)}"
        text = pair if len(pair) <= NAME_WIDTH else f"{text} /\n  {', '.join(param.secondary_opts)}"
    return text


def _help(param, console: Console, width: int) -> Text:
    """The help text (rich markup), then its choices, default and [required], each kept on one line: on
    the help's last line where it fits, else on a line of its own."""
    text = Text.from_markup(" ".join((param.help or "").split()))
    choices = _value_kind(param)[1]
    default = _default(param)
    notes = [
        (f"[choices: {', '.join(choices)}]", "dim") if choices else None,
        (f"[default: {default}]", "dim") if default is not None else None,
        ("[required]", "red") if param.required else None,
    ]
    for note, style in filter(None, notes):
        last = text.wrap(console, width)[-1].cell_len if text else 0
        text.append(("" if not text else " " if last + 1 + len(note) <= width else "\n") + note, style=style)
    return text


def _value_kind(param) -> tuple[str, list[str]]:
    """The metavar word of ``param``'s values and their choices (an Enum's values), from its annotation."""
    annotation = param.type_descriptor.annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "NAME", [member.value for member in annotation]
    if typing.get_origin(annotation) is list:  # a repeatable option: list[str]
        annotation = typing.get_args(annotation)[0]
    return METAVARS.get(annotation, "VALUE"), []


def _default(param) -> str | None:
    """The default shown in the help, or None (``show_default=False``, no value, or a flag left off)."""
    shown = getattr(param, "show_default", None)
    if shown is False or param.required:
        return None
    if isinstance(shown, str):
        return shown
    value = param.default
    if param.param_type_name == "option" and param.is_flag:
        if param.secondary_opts:
            return (param.opts if value else param.secondary_opts)[0]
        return None
    if value is None or callable(value) or value == []:
        return None
    return str(value.value if isinstance(value, enum.Enum) else value)
