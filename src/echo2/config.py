"""Typed configuration: a raw TOML table decoded into a msgspec Struct, errors as one line.

Every config class (``JobConfig``, each actor's ``Config``, the topology's tables) is a
Struct with ``forbid_unknown_fields=True``; enumerated values are ``Literal`` and bounds are
``Annotated[..., Meta(...)]``, so msgspec checks both while decoding. ``convert_config``
turns its errors into ``<field path>: <problem>``::

    actors.learner.config.old_policy: Expected one of 'sampler', 'learner', got 'learnr'
    actors.sink.config.typo: unknown field (allowed: expected_producers)
    job.staleness: Expected `int` >= 0
    actors.sampler.config.credits: Expected `int`, got the string "8" (write a number without quotes: 8)

Decoding is strict: TOML has real integers, floats and booleans, so a quoted value where a
number or a boolean belongs is the user's mistake and is refused, not converted (an
integer still fills a float field: ``lr = 1`` is ``1.0``).

``check_kwargs`` applies the same rules to the keyword arguments a topology passes to code it
names (a task factory, an engine class): each name must be a parameter of the signature and
each value must fit the parameter's annotation.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from echo2.errors import ConfigError, one_line

DEVICE_PATTERN = r"^(cpu|mps|meta|(cuda|xpu|npu|hpu)(:[0-9]+)?)$"
Device = Annotated[str, Meta(pattern=DEVICE_PATTERN)]
"""A torch device string: "cpu", "cuda", "cuda:N", "mps" (and xpu/npu/hpu, with an index)."""

NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_-]*$"
Name = Annotated[str, Meta(pattern=NAME_PATTERN)]
"""A name that is also a file name and a URL part: letters, digits, "_" and "-"."""

# What a pattern means, for the error message (msgspec only quotes the regex).
_PATTERN_MEANINGS = {
    DEVICE_PATTERN: "a torch device ('cpu', 'cuda', 'cuda:N', 'mps', 'xpu:N', ...)",
    NAME_PATTERN: "a name of letters, digits, '_' and '-', not starting with '-'",
}

_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")
_INVALID_ENUM = re.compile(r"^Invalid enum value (?P<value>.*)$")
_PATTERN = re.compile(r"^Expected `str` matching regex '(?P<pattern>.*)'$")
_WRONG_TYPE = re.compile(r"^Expected `(?P<expected>[^`]*)`, got `str`$")
_PATH_PART = re.compile(r"\.(?P<field>[^.\[]+)|\[(?P<index>[^\]]*)\]")
_NUMBER = re.compile(r"^\s*[-+]?(\d[\d_]*\.?\d*([eE][-+]?\d+)?|\.\d+|inf|nan)\s*$")
_BOOLEAN = frozenset({"true", "false"})


def convert_config(raw: Mapping[str, Any], config_type: type[Any], path: str) -> Any:
    """Decode a raw TOML table into ``config_type``; ``ConfigError`` ``path.field: problem`` if invalid."""
    try:
        return msgspec.convert(dict(raw), config_type, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(one_line(exc), config_type, raw, path)) from None
    except (TypeError, ValueError) as exc:  # raised by a __post_init__ check
        raise ConfigError(one_line(exc), path=path) from None


def check_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any], path: str, *, name: str) -> None:
    """Check that ``factory(**kwargs)`` binds and that each value fits its parameter's annotation.

    ``name`` is what the message calls the factory (``'addition'``); errors name the
    keyword: ``path.digits: 'addition': Expected `int`, got the string "3" (...)``. A
    parameter named ``device`` must be a torch device (``Device``), since signatures type
    it as a plain ``str``. A factory declares a range as in a config: ``digits: Annotated[int, Meta(ge=1)]``. Annotations msgspec cannot check (a callable, a path-like) and a
    signature that cannot be read are left to the call.
    """
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no introspectable signature (a C callable): the call will tell
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{name}: {exc}", path=path) from None
    hints = _type_hints(factory)
    for key, value in kwargs.items():
        if key not in signature.parameters:
            continue  # taken by **kwargs: its type is the callee's business
        hint = Device if key == "device" else hints.get(key)
        if hint is None:
            continue
        try:
            msgspec.convert(value, hint, strict=True)
        except msgspec.ValidationError as exc:
            text = _describe(one_line(exc), hint, value, "").removeprefix(": ")
            raise ConfigError(f"{name}: {text}", path=f"{path}.{key}") from None
        except TypeError:
            continue  # a type msgspec does not decode (Callable, os.PathLike, a class)


def _type_hints(factory: Callable[..., Any]) -> dict[str, Any]:
    target: Callable[..., Any] = _constructor(factory) if isinstance(factory, type) else factory
    try:
        return typing.get_type_hints(target, include_extras=True)  # keep Meta bounds
    except (NameError, AttributeError, TypeError):  # a hint naming what is not importable at run time
        return {}


def _constructor(cls: type[Any]) -> Callable[..., Any]:
    return cls.__init__


def _describe(message: str, config_type: Any, raw: Any, path: str) -> str:
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
    found, value = _value_at(raw, where)
    if (match := _PATTERN.match(text)) and match["pattern"] in _PATTERN_MEANINGS:
        got = f", got {value!r}" if found else ""
        return f"{path}{where}: Expected {_PATTERN_MEANINGS[match['pattern']]}{got}"
    if (match := _WRONG_TYPE.match(text)) and found and isinstance(value, str):
        if match["expected"] in ("int", "float") and _NUMBER.match(value):
            return (
                f'{path}{where}: Expected `{match["expected"]}`, got the string "{value}" '
                f"(write a number without quotes: {value.strip()})"
            )
        if match["expected"] == "bool" and value.strip().lower() in _BOOLEAN:
            return (
                f'{path}{where}: Expected `bool`, got the string "{value}" '
                f"(write true or false without quotes: {value.strip().lower()})"
            )
    return f"{path}{where}: {text}"


def _value_at(raw: Any, where: str) -> tuple[bool, Any]:
    """The raw value at a decode-error path: (found, value); ``[...]`` (a dict key) is not found."""
    node = raw
    for part in _PATH_PART.finditer(where):
        key: Any = part["field"]
        if key is None:
            if not part["index"].isdigit():
                return False, None
            key = int(part["index"])
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _type_at(config_type: Any, where: str) -> mi.Type | None:
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


__all__ = ["DEVICE_PATTERN", "NAME_PATTERN", "Device", "Name", "check_kwargs", "convert_config"]
