"""The registry of kinds: every registered name resolves to the right kind of object, lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from echo2.actor import Actor
from echo2.actors import load_actor_class
from echo2.actors.learner import LearnerConfig
from echo2.engines.base import Engine
from echo2.errors import ConfigError, ResolveError
from echo2.registry import ACTORS, ENGINES, TASKS, EngineKind, Registry
from echo2.tasks.base import Task, load_task
from echo2.transport.endpoint import ENDPOINT_CLASSES, SocketKind

SRC = Path(__file__).resolve().parent.parent / "src" / "echo2"


@pytest.mark.parametrize("kind", ACTORS.names())
def test_every_actor_kind_resolves_to_its_class(kind: str) -> None:
    cls = load_actor_class(kind)
    assert issubclass(cls, Actor) and cls.kind == kind
    assert {port.socket for port in cls.ports.values()} <= set(ENDPOINT_CLASSES)


def test_engine_kinds_are_the_registered_engines() -> None:
    assert sorted(get_args(EngineKind)) == ENGINES.names()
    for kind in ENGINES.names():
        cls = ENGINES.resolve(kind, lambda obj: isinstance(obj, type) and issubclass(obj, Engine), "an Engine")
        assert issubclass(cls, Engine)


def test_socket_kinds_are_the_transport_endpoints() -> None:
    assert sorted(get_args(SocketKind)) == sorted(ENDPOINT_CLASSES)


def test_every_model_dtype_is_one_the_models_know() -> None:
    from echo2.models.hf import torch_dtype

    names = get_args(get_type_hints(LearnerConfig)["model_dtype"])
    assert "float32" in names and "bfloat16" in names
    for name in names:
        torch_dtype(name)  # ValueError for a name the models do not know


@pytest.mark.parametrize("name", TASKS.names())
def test_every_builtin_task_resolves(name: str) -> None:
    factory = TASKS.resolve(name, callable, "a task factory")
    # a dataset needs its file: the shipped example's
    shipped = SRC.parents[1] / "examples" / "data" / "addition500.jsonl"
    kwargs = {"path": str(shipped), "prompt_field": "question"} if name == "dataset" else {}
    if name != "reasoning_gym":  # its prompts need the optional reasoning-gym package
        assert isinstance(factory(**kwargs), Task)
        assert isinstance(load_task(name, **kwargs), Task)


def test_unknown_names_and_paths() -> None:
    registry: Registry[str] = Registry("widget", {"a": "echo2.errors:ConfigError"}, path_form="package.module:Class")
    with pytest.raises(ResolveError, match=r"^unknown widget 'b' \(known: a; or 'package.module:Class'\)$"):
        registry.resolve("b", callable, "x")
    with pytest.raises(ResolveError, match=r"^'echo2.errors:ConfigError' is not a function$"):
        registry.resolve("a", lambda obj: False, "a function")
    assert registry.resolve("echo2.errors:ResolveError", callable, "x") is ResolveError
    with pytest.raises(ResolveError, match=r"^unknown engine 'echo2.engines.simulated:SimulatedEngine' \(known: hf, "):
        ENGINES.resolve("echo2.engines.simulated:SimulatedEngine", callable, "x")  # names only
    error = ResolveError("x")
    assert isinstance(error, ConfigError) and isinstance(error, ValueError)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_registry_sits_below_everything_it_names() -> None:
    assert {m for m in _imports(SRC / "registry.py") if m.startswith("echo2")} == {"echo2.errors"}
    # tasks/base names its implementations through the registry: no import cycle in tasks/
    assert not {m for m in _imports(SRC / "tasks" / "base.py") if m.startswith("echo2.tasks.")}


def test_naming_a_kind_imports_nothing_until_it_is_resolved() -> None:
    code = (
        "import sys, echo2.registry, echo2.actors, echo2.tasks.base, echo2.engines;"
        "print(sorted(m for m in sys.modules if m.startswith(('echo2.actors.', 'echo2.engines.')) or m == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip() == "['echo2.engines.base']"
