"""Command-line flags generated from a config dataclass, so the flags cannot drift from the
configs: one ``--field-name`` per field, its help line taken from the field's docstring
(the string right after the field, as Sphinx and tyro read it), with its default and its
allowed values (``Literal`` types become choices, ``bool`` fields ``--x/--no-x`` flags).

Every flag defaults to None, meaning "not given", so a config file's values and a run's
recorded ones apply unless the command line names the field. Torch-free, like the rest of
the argument parsing.
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


def add_config_flags(group: Any, cls: type, *, dest_prefix: str,
                     default_note: Callable[[str, Any], str] | None = None) -> None:
    """Add one flag per field of the dataclass ``cls`` to ``group`` (a parser or an
    argument group). The value lands in ``dest_prefix + field name``; ``default_note``
    words a field's default for its help line (default: ``default: <value>``)."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    for item in dataclasses.fields(cls):
        kind, _optional = _parts(hints[item.name])
        default = (f"default: {shown(item.default)}" if default_note is None
                   else default_note(item.name, item.default))
        doc = docs.get(item.name, "")
        flag, dest = "--" + item.name.replace("_", "-"), dest_prefix + item.name
        help_line = f"{doc.rstrip('.')} ({default})" if doc else f"({default})"
        if kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                               default=None, help=help_line)
        elif get_origin(kind) is Literal:
            group.add_argument(flag, dest=dest, choices=get_args(kind), default=None,
                               help=help_line)
        elif kind in (int, float):
            word = "an integer" if kind is int else "a number"
            group.add_argument(flag, dest=dest, type=_number(kind, word), default=None,
                               metavar="N" if kind is int else "X", help=help_line)
        else:
            group.add_argument(flag, dest=dest, default=None, metavar="TEXT", help=help_line)


def given(namespace: argparse.Namespace, dest_prefix: str) -> dict[str, Any]:
    """The fields the command line named: ``{field: value}`` of the flags that were given."""
    return {name[len(dest_prefix):]: value for name, value in vars(namespace).items()
            if name.startswith(dest_prefix) and value is not None}
