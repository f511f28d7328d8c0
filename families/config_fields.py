"""Typed, documented config sections: the machinery behind every section of the YAML file.

A section is a frozen dataclass whose fields carry their default, their documentation
(``metadata["doc"]``) and optional numeric limits (``ge``/``gt``/``le``/``lt``); construction
validates types, choices and limits and then the section's own cross-key rules (``_check``),
each failure a one-line ``ConfigError`` naming the dotted key. training/config_schema.py
declares the run's sections with it; a model family declares its ``model`` section
(families/sections.py, families/gpt.py), so each family's keys, defaults and rules live with
the family. docs/CONFIG.md is generated from the fields.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

__all__ = ["ConfigError", "FieldSpec", "Section", "doc_field", "field_spec", "show_value"]


class ConfigError(ValueError):
    """A configuration problem; the message is one line, starts with 'config:' and names the key.

    The entry point prints it (no traceback) and exits with status 2.
    """


def doc_field(default: Any, doc: str, **limits: float) -> Any:
    """A field with documentation and optional numeric limits (ge, gt, le, lt)."""
    return field(default=default, metadata={"doc": doc, **limits})


def show_value(value: Any) -> str:
    """Render a value the way the YAML user wrote it: null/true/false, strings quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    # Messages must stay one short line even when someone passes a whole mapping.
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class FieldSpec:
    """What a field accepts, decoded from its annotation (used by validation and the docs)."""

    kind: type  # int, float, bool or str
    optional: bool
    choices: tuple[str, ...] | None


@functools.cache
def field_spec(cls: type, name: str) -> FieldSpec:
    hint = typing.get_type_hints(cls)[name]
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional, hint = True, args[0]
    if typing.get_origin(hint) is Literal:
        return FieldSpec(str, optional, typing.get_args(hint))
    return FieldSpec(hint, optional, None)


_KIND_WORDS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}
_LIMITS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


class Section:
    """Shared validation for the section dataclasses (field types, enums, numeric limits)."""

    SECTION: ClassVar[str] = ""
    FAMILY: ClassVar[str] = ""  # model sections: the model family whose runs they configure

    def check_parallel(self, parallel) -> None:
        """Rules that need the ``parallel`` section too (a model section's split rules);
        ``Config`` calls it. Raise ``ConfigError`` naming the keys."""

    def check_config(self, cfg) -> None:
        """Rules that need other sections of the run's config ``cfg`` (a data section's);
        ``Config`` calls it. Raise ``ConfigError`` naming the keys."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = _check_field(self, f, getattr(self, f.name))
            # Frozen: normalise ints given for float fields so the round trip is type-exact.
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Cross-field checks inside the section; overridden where needed."""

    def _err(self, msg: str) -> ConfigError:
        return ConfigError(f"config: {msg}")

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}"


def _check_field(section: Section, f: dataclasses.Field, value: Any) -> Any:
    key = section._key(f.name)
    spec = field_spec(type(section), f.name)
    if value is None and spec.optional:
        return None
    if spec.kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
        if not math.isfinite(value):
            raise section._err(f"{key} must be a finite number, got {show_value(value)}")
    # Strict: bool is an int subclass and 3.0 is not an int; neither is accepted for int fields.
    elif type(value) is not spec.kind:
        words = _KIND_WORDS[spec.kind] + (" or null" if spec.optional else "")
        raise section._err(f"{key} must be {words}, got {show_value(value)}")
    if spec.choices is not None and value not in spec.choices:
        hint = [c for c in spec.choices if c.lower() == value.lower()]
        suffix = f" (did you mean '{hint[0]}'?)" if hint else ""
        choices = ", ".join(spec.choices)
        raise section._err(f"{key} must be one of {choices}, got {show_value(value)}{suffix}")
    if value == "":
        raise section._err(f"{key} must be a non-empty string")
    for name, bound in f.metadata.items():
        if name in _LIMITS and not _LIMITS[name][0](value, bound):
            raise section._err(f"{key} must be {_LIMITS[name][1]} {bound:g}, got {value!r}")
    return value
