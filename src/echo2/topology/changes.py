"""What a ``--resume`` would change: the fields where a new resolved topology differs from a recorded one.

``--resume`` continues a run with the settings it was run with. A ``--set`` forgotten (or
added) on the resume's command line would silently train on other settings, so the
launcher compares the newly resolved topology with the one the run last ran with
(``RunDir.current_topology_path``) and refuses unless told ``--allow-changes``; the
changes it allowed are recorded in ``resumes.jsonl`` (``echo2.rundir``).

Fields are compared as JSON values, one dotted path per leaf (``job.staleness``,
``processes.learner.actors[0].config.lr``); a table or list present on one side only is one
change at its own path. Not compared: ``resume`` (always true now) and ``run.run_dir`` (the
parent of new run directories, which a resume does not use). A run recorded by an older
echo2 lacks the fields added since: the recorded topology is read with today's schema first,
so such a field counts as its default, and only a value other than the default is a change.
Actor config tables are compared as written (the resolved topology keeps them raw).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from echo2.topology.resolve import ResolvedTopology

IGNORED_FIELDS = frozenset({"resume", "run.run_dir"})
"""Paths that may differ between a run and its resume without being a change."""


class FieldChange(msgspec.Struct, frozen=True, kw_only=True):
    """One field whose value differs between the recorded topology and the new one."""

    field: str
    """Dotted path, with ``[i]`` for list items: ``processes.learner.actors[0].config.lr``."""
    recorded: Any = None
    """The value the run last ran with (None when the field was absent)."""
    new: Any = None
    """The value resolved now (None when the field is gone)."""

    def describe(self) -> str:
        return f"{self.field}: {_show(self.recorded)} -> {_show(self.new)}"


_ABSENT = object()


def topology_changes(recorded: Any, new: ResolvedTopology) -> list[FieldChange]:
    """The changes from ``recorded`` (the JSON value of a ``topology.resolved.json``) to ``new``, by path."""
    changes: list[FieldChange] = []
    # As the file holds it (a JSON round trip: tuples become lists, as they do on disk).
    _compare("", _with_defaults(recorded), json.loads(msgspec.json.encode(new)), changes)
    return changes


def _with_defaults(recorded: Any) -> Any:
    """``recorded`` with the defaults of fields it predates filled in; as it is when today's
    schema cannot read it (a field since removed: that one is then listed as a change)."""
    try:
        return json.loads(msgspec.json.encode(msgspec.convert(recorded, ResolvedTopology)))
    except msgspec.ValidationError:
        return recorded


def _compare(path: str, old: Any, new: Any, out: list[FieldChange]) -> None:
    if path in IGNORED_FIELDS:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys()):
            _compare(f"{path}.{key}" if path else str(key), old.get(key, _ABSENT), new.get(key, _ABSENT), out)
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for index, (a, b) in enumerate(zip(old, new, strict=True)):
            _compare(f"{path}[{index}]", a, b, out)
    elif old != new or type(old) is not type(new):  # 1 vs 1.0 vs True: a TOML type change is a change
        out.append(
            FieldChange(
                field=path or "$",
                recorded=None if old is _ABSENT else old,
                new=None if new is _ABSENT else new,
            )
        )


def _show(value: Any) -> str:
    text = "(absent)" if value is None else json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["IGNORED_FIELDS", "FieldChange", "topology_changes"]
