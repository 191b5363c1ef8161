"""Command-line flags generated from ``CacheConfig``'s fields: one ``--option-name`` per field,
its text converted by the field's annotation and the value checked by ``CacheConfig`` itself
(a bad value raises the same ``ConfigError`` naming the option as in Python)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from typing import Any

from kvtier.config import CacheConfig

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal after its annotation), first sentence."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:], strict=False):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            text = " ".join(b.value.value.split())
            docs[a.target.id] = text.split(". ")[0].rstrip(".").replace("%", "%%")
    return docs


def _converter(annotation: str) -> Any:
    """Text -> value for a field annotated ``annotation`` (a string under postponed
    annotations). Text that does not convert is passed on unchanged so that ``CacheConfig``
    reports it, naming the option."""
    kinds = [k.strip() for k in annotation.split("|")]
    nullable = "None" in kinds
    base = next((k for k in kinds if k != "None"), "str")

    def convert(text: str) -> Any:
        if nullable and text.lower() in ("none", "null"):
            return None
        if base == "bool":
            low = text.lower()
            return True if low in _TRUE else False if low in _FALSE else text
        if base in ("int", "float"):
            try:
                return int(text) if base == "int" else float(text)
            except ValueError:
                return text
        if base.startswith("tuple"):
            return tuple(x for x in text.split(",") if x)
        return text

    return convert


def add_cache_config_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``CacheConfig`` field; unset flags keep the dataclass defaults."""
    group = parser.add_argument_group("cache (CacheConfig fields)")
    docs = _docstrings(CacheConfig)
    for f in dataclasses.fields(CacheConfig):
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        default = (
            f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        )
        extra = " (comma-separated)" if annotation.startswith("tuple") else ""
        group.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f"cache_{f.name}",
            metavar=annotation.replace(" ", "").upper() if annotation != "str" else "TEXT",
            type=_converter(annotation),
            default=argparse.SUPPRESS,
            help=f"{docs.get(f.name, f.name)}{extra} (default: {default!r})",
        )


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    """The ``CacheConfig`` of the flags given; raises ``ConfigError`` naming a bad option."""
    given = {k.removeprefix("cache_"): v for k, v in vars(args).items() if k.startswith("cache_")}
    return CacheConfig(**given)
