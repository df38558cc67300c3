"""Typed configuration: a raw TOML table decoded into a msgspec Struct, errors as one line.

Every config class (``JobConfig``, each actor's ``Config``, the topology's tables) is a
Struct with ``forbid_unknown_fields=True``; enumerated values are ``Literal`` and bounds are
``Annotated[..., Meta(...)]``, so msgspec checks both while decoding. ``convert_config``
turns its errors into ``<field path>: <problem>``::

    actors.learner.config.old_policy: Expected one of 'sampler', 'learner', got 'learnr'
    actors.sink.config.typo: unknown field (allowed: expected_producers)
    job.staleness: Expected `int` >= 0
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec
import msgspec.inspect as mi

from echo2.errors import ConfigError

_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")
_INVALID_ENUM = re.compile(r"^Invalid enum value (?P<value>.*)$")
_PATH_PART = re.compile(r"\.(?P<field>[^.\[]+)|\[[^\]]*\]")


def convert_config(raw: Mapping[str, Any], config_type: type[Any], path: str) -> Any:
    """Decode a raw TOML table into ``config_type``; ``ConfigError`` ``path.field: problem`` if invalid."""
    try:
        return msgspec.convert(dict(raw), config_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(" ".join(str(exc).split()), config_type, path)) from None
    except (TypeError, ValueError) as exc:  # raised by a __post_init__ check
        raise ConfigError(" ".join(str(exc).split()), path=path) from None


def _describe(message: str, config_type: type[Any], path: str) -> str:
    """'Invalid enum value 'x' - at `$.a[0].b`' -> 'path.a[0].b: Expected one of ..., got 'x''."""
    text, sep, where = message.rpartition(" - at `")
    if not sep:  # an error about the table itself
        text, where = message, ""
    where = where.rstrip("`").removeprefix("$")
    if match := _UNKNOWN_FIELD.match(text):
        struct = _type_at(config_type, where)
        fields = [f.name for f in struct.fields] if isinstance(struct, mi.StructType) else []
        allowed = f" (allowed: {', '.join(fields)})" if fields else ""
        return f"{path}{where}.{match['field']}: unknown field{allowed}"
    if match := _MISSING_FIELD.match(text):
        return f"{path}{where}.{match['field']}: missing required field"
    if match := _INVALID_ENUM.match(text):
        literal = _type_at(config_type, where)
        if isinstance(literal, mi.LiteralType):
            choices = ", ".join(repr(v) for v in literal.values)
            return f"{path}{where}: Expected one of {choices}, got {match['value']}"
    return f"{path}{where}: {text}"


def _type_at(config_type: type[Any], where: str) -> mi.Type | None:
    """The msgspec type at a decode-error path (``.field``, ``[0]``, ``[...]``), or None."""
    node: mi.Type | None = mi.type_info(config_type)
    for part in _PATH_PART.finditer(where):
        node = _unwrap(node)
        if part["field"] is not None:
            fields = {f.encode_name: f.type for f in node.fields} if isinstance(node, mi.StructType) else {}
            node = fields.get(part["field"])
        elif isinstance(node, mi.DictType):
            node = node.value_type
        elif isinstance(node, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
            node = node.item_type
        else:
            node = None
        if node is None:
            return None
    return _unwrap(node)


def _unwrap(node: mi.Type | None) -> mi.Type | None:
    """Strip ``Annotated`` metadata and ``X | None``: the type a value was decoded as."""
    while isinstance(node, mi.Metadata | mi.UnionType):
        if isinstance(node, mi.Metadata):
            node = node.type
            continue
        members = [t for t in node.types if not isinstance(t, mi.NoneType)]
        if len(members) != 1:
            break
        node = members[0]
    return node


__all__ = ["convert_config"]
