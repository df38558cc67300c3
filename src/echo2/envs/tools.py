"""Tools as typed methods: an environment whose actions call its methods.

A subclass of :class:`ToolEnvironment` marks methods with :func:`tool`; their signatures
(annotated parameters) and docstrings are the tools' schemas (:meth:`ToolEnvironment.tool_schemas`,
JSON Schema, for a system prompt that lists them). The model calls a tool by writing one
call in its turn, in the Hermes / Qwen format::

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

The arguments are converted to the annotated types (``msgspec``, strictly: ``"3"`` is not
an ``int``); the tool's return value, as text, is the observation, wrapped in
``<tool_response>...</tool_response>``. A malformed call, an unknown tool, arguments that
do not fit or a tool that raises a ``ToolError`` answer with the error as the observation
(the model's mistake, part of the episode; any other exception is the environment failing).
A turn without a tool call is the final answer: the episode ends with
``score(answer)`` as its reward. Everything is deterministic in the actions as long as
the tools are, so the trusted side replays tool episodes like any other.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar, get_type_hints

import msgspec

from echo2.envs.base import Action, Observation, StepResult
from echo2.tasks.base import Prompt

F = TypeVar("F", bound=Callable[..., Any])
_TOOL = "__echo2_tool__"


def tool(method: F) -> F:
    """Mark a method of a :class:`ToolEnvironment` as a tool the model may call."""
    setattr(method, _TOOL, True)
    return method


class ToolError(Exception):
    """Raised by a tool for a call the model got wrong: the message is the observation."""


class ToolEnvironment:
    """Base of environments whose actions call typed tools (see the module docstring)."""

    replayable = True
    call_start, call_end = "<tool_call>", "</tool_call>"
    result_start, result_end = "<tool_response>", "</tool_response>"

    def __init__(self) -> None:
        self.prompt: Prompt | None = None
        self.seed = 0
        self.calls = 0

    def reset(self, prompt: Prompt, seed: int) -> Observation:
        self.prompt, self.seed, self.calls = prompt, seed, 0
        return None

    def score(self, answer: str) -> float:
        """The reward of the final answer (override); 0 by default."""
        del answer
        return 0.0

    def step(self, action: Action) -> StepResult:
        text = action.text
        match = re.search(re.escape(self.call_start) + r"(.*?)" + re.escape(self.call_end), text, re.DOTALL)
        if match is None:
            return StepResult(reward=float(self.score(text.strip())), done=True)
        self.calls += 1
        return StepResult(observation=f"{self.result_start}{self._call(match[1])}{self.result_end}")

    def _call(self, payload: str) -> str:
        try:
            call = json.loads(payload)
        except json.JSONDecodeError as exc:
            return f"error: the call is not JSON ({exc.msg})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return 'error: a call is {"name": ..., "arguments": {...}}'
        method = self._tools().get(call["name"])
        if method is None:
            return f"error: no tool {call['name']!r} (tools: {', '.join(sorted(self._tools()))})"
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            return "error: arguments must be an object"
        try:
            bound = _convert(method, arguments)
        except (TypeError, msgspec.ValidationError) as exc:
            return f"error: {exc}"
        try:
            return str(method(**bound))
        except ToolError as exc:
            return f"error: {exc}"

    def _tools(self) -> dict[str, Callable[..., Any]]:
        return {
            name: getattr(self, name)
            for name, member in inspect.getmembers(type(self), callable)
            if getattr(member, _TOOL, False)
        }

    def tool_schemas(self) -> list[dict[str, Any]]:
        """Each tool as ``{"name", "description", "parameters"}`` (JSON Schema of its arguments)."""
        out = []
        for name, method in sorted(self._tools().items()):
            hints = get_type_hints(method)
            parameters = inspect.signature(method).parameters
            properties = {p: msgspec.json.schema(hints.get(p, Any)) for p in parameters}
            required = [p for p, spec in parameters.items() if spec.default is inspect.Parameter.empty]
            out.append(
                {
                    "name": name,
                    "description": inspect.getdoc(method) or "",
                    "parameters": {"type": "object", "properties": properties, "required": required},
                }
            )
        return out


def _convert(method: Callable[..., Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments bound to ``method``'s signature and converted to its annotations."""
    signature = inspect.signature(method)
    bound = signature.bind(**arguments)  # TypeError: missing or unknown argument
    hints = get_type_hints(method)
    return {name: msgspec.convert(value, hints.get(name, Any), strict=True) for name, value in bound.arguments.items()}
