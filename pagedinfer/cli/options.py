"""The typer options of ``pagedinfer run`` and ``pagedinfer bench``, made from the settings' declarations.

A command lists the dataclasses whose settings it offers (`config.settings`); `offering` gives its
function one typer parameter per setting that has a flag (its type, default, help, panel, metavar
and choices as declared, and a hidden one for a former name; a ``dict`` is read as a JSON object),
grouped by help panel in `PANELS`' order, in declaration order within a panel. `given` reads the
values back (a choice as its text, a former name as the setting it names); `build` makes the
dataclass of them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import typer

from pagedinfer.config import Setting, settings

PANELS = {  # the help panels, in the order they are shown (None: typer's first, "Options")
    None: None,
    "sampling": "Sampling (defaults; per-line fields override)",
    "pool": "KV cache and scheduling",
    "lora": "LoRA adapters",
    "output": "Output and reporting",
    "scale": r"Data parallel on Ray (pip install 'pagedinfer\[ray]')",  # \[: not rich markup
}


class OptionError(Exception):
    """Two names of one option were given; the message is one line."""


def declared(cls: type) -> list[Setting]:
    """The settings of ``cls`` in field order, a field holding a dataclass of settings (``bench``'s
    cuts) in place of its own."""
    inner = {f.name: f.type for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    own = {s.name: s for s in settings(cls)}
    found: list[Setting] = []
    for name in inner:
        if name in own:
            found.append(own[name])
        elif dataclasses.is_dataclass(hints[name]) and settings(hints[name]):
            found.extend(declared(hints[name]))
    return found


def offering(*groups: Iterable[Setting]) -> Callable[[Callable], Callable]:
    """Give a command function (``def run(ctx, prompts, **values)``) a typer parameter per setting."""

    def decorate(function: Callable) -> Callable:
        own = inspect.signature(function, eval_str=True).parameters.values()
        own = [p for p in own if p.kind != p.VAR_KEYWORD]
        found = [s for group in groups for s in group if s.flags]
        found.sort(key=lambda s: list(PANELS).index(s.option.panel))  # stable: declaration order within
        function.__signature__ = inspect.Signature(own + [p for s in found for p in _parameters(s)])
        function.settings = found
        return function

    return decorate


def given(function: Callable, ctx: typer.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The values of ``function``'s settings: a choice as its text; a former name's value as the
    setting's (an `OptionError` when both names were given)."""
    out = {}
    for s in function.settings:
        value = values[s.name]
        if s.option.old_flag is not None and (old := values[_old_name(s)]) is not None:
            if ctx.get_parameter_source(s.name).name == "COMMANDLINE":
                raise OptionError(f"{s.option.old_flag} is the old name of {s.flag}: give one of them")
            value = old
        out[s.name] = value.value if isinstance(value, enum.Enum) else value
    return out


def build(cls: type, values: dict[str, Any], **overrides: Any) -> Any:
    """``cls`` of the command-line ``values`` of its settings (`declared`), ``overrides`` winning."""
    hints = typing.get_type_hints(cls)
    own = {s.name for s in settings(cls)}
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif f.name in own:
            kwargs[f.name] = values[f.name]
        elif dataclasses.is_dataclass(hints[f.name]) and settings(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values)
    return cls(**kwargs)


def _parameters(s: Setting) -> list[inspect.Parameter]:
    """The typer parameter of ``s`` and, for a former name, a hidden one (None unless given)."""
    kind, o = inspect.Parameter.KEYWORD_ONLY, s.option
    value_type, default = _value_type(s), s.cli_default
    if isinstance(value_type, type) and issubclass(value_type, enum.Enum) and default is not None:
        default = value_type(default)
    info = typer.Option(
        *s.flags,
        help=o.help,
        rich_help_panel=PANELS[o.panel],
        metavar=o.metavar,
        show_default=o.show_default,
        parser=_json_object if value_type is dict else None,  # typer reads no dict of its own
    )
    params = [
        inspect.Parameter(s.name, kind, default=default, annotation=Annotated[_optional(s, value_type), info])
    ]
    if o.old_flag is not None:
        hidden = typer.Option(o.old_flag, hidden=True)
        params.append(
            inspect.Parameter(
                _old_name(s), kind, default=None, annotation=Annotated[value_type | None, hidden]
            )
        )
    return params


def _json_object(text: str) -> dict:
    """A JSON object option's value (``--speculative-config``)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"a JSON object is needed, not {text!r}")
    return value


def _value_type(s: Setting) -> Any:
    """What the command line reads: an Enum of the choices, the declared command-line type, or the field's."""
    if s.option.choices is not None:
        return _choices(s.name, s.option.choices)
    return s.option.cli_type or s.type


@functools.cache
def _choices(name: str, values: tuple[str, ...]) -> type[enum.Enum]:
    """An Enum of ``values`` (typer offers an Enum's values as the choices, in order)."""
    title = "".join(part.title() for part in name.split("_"))
    return enum.Enum(title, {v.replace("-", "_"): v for v in values}, type=str)


def _optional(s: Setting, value_type: Any) -> Any:
    """``value_type``, or None too where the command line's default is None."""
    if s.cli_default is None and type(None) not in typing.get_args(value_type):
        return value_type | None
    return value_type


def _old_name(s: Setting) -> str:
    return s.option.old_flag.removeprefix("--").replace("-", "_")
