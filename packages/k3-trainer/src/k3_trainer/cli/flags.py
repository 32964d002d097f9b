"""Command-line flags generated from dataclasses, so flags cannot drift from what they set:
one ``--field-name`` per field, its help line taken from the field's docstring (the
string right after the field, as Sphinx and tyro read it), with its default and its
allowed values (``Literal`` types become choices).

Two kinds of dataclass become flags:

- a config (``TrainConfig``, a model's config), by :func:`add_config_flags`: every flag
  defaults to None, meaning "not given", so a config file's values and a run's recorded
  ones apply unless the command line names the field; ``bool`` fields are ``--x/--no-x``;
- a subcommand's own options (:mod:`k3_trainer.cli.options`), by :func:`add_option_flags`:
  the field's default is the flag's, a field without one is a required flag, a ``False``
  bool is a switch, and :func:`option` adds what a type cannot say (a parser, a metavar,
  a positional argument, a mutually exclusive group). :func:`options_from` turns the
  parsed namespace back into the dataclass.

Torch-free, like the rest of the argument parsing.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import textwrap
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


@functools.cache
def field_docs(cls: type) -> Mapping[str, str]:
    """Each field's docstring, whitespace folded to one line ({} without the source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):  # no source shipped: help without docs
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _parts(hint: Any) -> tuple[Any, bool]:
    """``hint`` without ``None``, and whether ``None`` was allowed."""
    if get_origin(hint) in (Union, types.UnionType):
        rest = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(get_args(hint))
    return hint, False


def _number(kind: type, name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
    return parse


def shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "pipeline_parallel": ("--pp",),
    "context_parallel": ("--cp",),
}
"""Shorter spellings of a field's flag, as the launchers people know spell them."""


def add_config_flags(group: Any, cls: type, *, dest_prefix: str,
                     default_note: Callable[[str, Any], str] | None = None) -> None:
    """Add one flag per field of the dataclass ``cls`` to ``group`` (a parser or an
    argument group). The value lands in ``dest_prefix + field name``; ``default_note``
    words a field's default for its help line (default: ``default: <value>``); a field in
    :data:`FLAG_ALIASES` also gets its shorter flags."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    for item in dataclasses.fields(cls):
        kind, _optional = _parts(hints[item.name])
        default = (f"default: {shown(item.default)}" if default_note is None
                   else default_note(item.name, item.default))
        doc = docs.get(item.name, "")
        dest = dest_prefix + item.name
        flags = ("--" + item.name.replace("_", "-"), *FLAG_ALIASES.get(item.name, ()))
        help_line = f"{doc.rstrip('.')} ({default})" if doc else f"({default})"
        if kind is bool:
            group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction,
                               default=None, help=help_line)
        elif get_origin(kind) is Literal:
            group.add_argument(*flags, dest=dest, choices=get_args(kind), default=None,
                               help=help_line)
        elif kind in (int, float):
            word = "an integer" if kind is int else "a number"
            group.add_argument(*flags, dest=dest, type=_number(kind, word), default=None,
                               metavar="N" if kind is int else "X", help=help_line)
        else:
            group.add_argument(*flags, dest=dest, default=None, metavar="TEXT",
                               help=help_line)


def given(namespace: argparse.Namespace, dest_prefix: str) -> dict[str, Any]:
    """The fields the command line named: ``{field: value}`` of the flags that were given."""
    return {name[len(dest_prefix):]: value for name, value in vars(namespace).items()
            if name.startswith(dest_prefix) and value is not None}


@dataclass(frozen=True)
class Flag:
    """What a subcommand option's type does not say about its flag."""

    parse: Callable[[str], Any] | None = None
    """Turns the text into the value (raise ``argparse.ArgumentTypeError`` to refuse it)."""
    metavar: str | None = None
    positional: bool = False
    """A positional argument (``nargs="*"`` for a list field) instead of ``--name``."""
    group: str | None = None
    """Options of one group are mutually exclusive."""
    group_required: bool = False
    """One option of the group must be given."""
    repeat: bool = False
    """May be given several times; the field receives the list (None when never given)."""
    collect: str | None = None
    """Not a flag: the field receives the generated config flags of this ``dest_prefix``
    that were given (:func:`given`)."""


def option(default: Any = MISSING, *, default_factory: Any = MISSING,
           **flag: Any) -> Any:
    """A subcommand option field with :class:`Flag` settings (its docstring is its help)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"flag": Flag(**flag)})


def _flag(item: dataclasses.Field[Any]) -> Flag:
    found = item.metadata.get("flag")
    return found if isinstance(found, Flag) else Flag()


def add_option_flags(parser: argparse.ArgumentParser, cls: type, *,
                     choices: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """Add the options of the dataclass ``cls`` to ``parser``, each landing in its field's
    name; ``choices`` restricts fields whose values are known only now (a model's
    presets)."""
    hints, docs, choices = get_type_hints(cls), field_docs(cls), choices or {}
    groups: dict[str, Any] = {}
    for item in dataclasses.fields(cls):
        flag = _flag(item)
        if flag.collect is not None:
            continue
        kind, _optional = _parts(hints[item.name])
        has_default = (item.default is not MISSING
                       or item.default_factory is not MISSING)
        doc = docs.get(item.name, "").rstrip(".")
        shown_default = not any(item.default is nothing for nothing in (MISSING, None, False)
                                ) and item.default != ""
        help_line = f"{doc} (default: {shown(item.default)})" if shown_default else doc
        kwargs: dict[str, Any] = {"help": help_line}
        if kind is bool:
            kwargs.update(action="store_true")
        elif flag.repeat:
            kwargs.update(action="append")
            if flag.metavar is not None:
                kwargs["metavar"] = flag.metavar
        else:
            if item.name in choices:
                kwargs["choices"] = choices[item.name]
                kwargs["metavar"] = "{" + ",".join(choices[item.name]) + "}"
            elif get_origin(kind) is Literal:
                kwargs["choices"] = get_args(kind)
            if flag.parse is not None:
                kwargs["type"] = flag.parse
            elif kind in (int, float):
                kwargs["type"] = _number(kind, "an integer" if kind is int else "a number")
            elif kind is Path:
                kwargs["type"] = Path
            if flag.metavar is not None:
                kwargs["metavar"] = flag.metavar
        target = parser
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = parser.add_mutually_exclusive_group(
                    required=flag.group_required)
            target = groups[flag.group]
        if flag.positional:
            if get_origin(kind) is list:
                kwargs["nargs"] = "*"
            target.add_argument(item.name, **kwargs)
            continue
        if has_default:
            kwargs["default"] = (item.default if item.default is not MISSING
                                 else item.default_factory())  # type: ignore[operator]
        elif flag.group is None:
            kwargs["required"] = True
        target.add_argument("--" + item.name.replace("_", "-"), dest=item.name, **kwargs)


def options_from(namespace: argparse.Namespace, cls: type) -> Any:
    """The dataclass ``cls`` from a namespace :func:`add_option_flags` filled."""
    values: dict[str, Any] = {}
    for item in dataclasses.fields(cls):
        collect = _flag(item).collect
        values[item.name] = (given(namespace, collect) if collect is not None
                             else getattr(namespace, item.name))
    return cls(**values)
