"""OpenEnv environments (``openenv-core``, the ``openenv`` extra) as echo2 environments.

``environment = "openenv"`` with ``environment_kwargs``:

- ``base_url``: a running OpenEnv server (``http://host:port``: an ``openenv serve``d
  environment, its container, a Space). Each episode is one session of OpenEnv's own
  client (``GenericEnvClient``, a WebSocket), reset with the lease's seed. A server is an
  external service: its episodes cannot be replayed by the trusted side, so
  ``replayable`` defaults to False and only ``job.episode.trusted_samplers`` are believed
  (their returns are the rewards). Say ``replayable = true`` only for a server that is
  deterministic given the seed and that the Rewarder can reach too.
- or ``environment``: ``"module:Class"`` of an OpenEnv ``Environment`` subclass run in this
  process (the server-side class), with ``action``: ``"module:Class"`` of its ``Action``.
  Replayable by default (say ``replayable = false`` when it is not deterministic given
  the seed). A ``reset`` that takes no ``seed`` is called without it, as OpenEnv's server
  does.

The mapping: the model's action text is the action's ``action_field``
(``{"message": text}``); the observation appended is the text of the observation's
``observation_field`` ("" appends nothing: the environment only scores); OpenEnv's
``reward`` (None: 0) is the turn's reward and ``done`` ends the episode. With
``prompt_field``, the prompt's text is passed to ``reset`` under that name; the reset's
observation is appended after the prompt unless ``reset_observation = false``.
"""

from __future__ import annotations

import inspect
from typing import Any

from echo2.envs.base import Action, Observation, StepResult
from echo2.registry import import_object
from echo2.tasks.base import Prompt


class OpenEnvEnvironment:
    """One episode in an OpenEnv environment (see the module docstring)."""

    def __init__(
        self,
        base_url: str = "",
        environment: str = "",
        action: str = "",
        action_field: str = "message",
        observation_field: str = "",
        prompt_field: str = "",
        replayable: bool | None = None,
        reset_observation: bool = True,
        message_timeout_s: float = 60.0,
    ) -> None:
        if bool(base_url) == bool(environment):
            raise ValueError("openenv: give base_url (a running server) or environment (a class), not both or neither")
        if environment and not action:
            raise ValueError("openenv: an in-process environment needs its action class (action = 'module:Class')")
        self.base_url, self.action_field = base_url, action_field
        self.observation_field, self.prompt_field = observation_field, prompt_field
        self.message_timeout_s, self.reset_observation = message_timeout_s, reset_observation
        self.replayable = (not base_url) if replayable is None else replayable
        self._environment_class = import_object(environment) if environment else None
        self._action_class = import_object(action) if action else None
        self._session: Any = None  # the client (remote) or the environment (in process), per episode

    def reset(self, prompt: Prompt, seed: int) -> Observation:
        self.close()
        kwargs: dict[str, Any] = {"seed": seed}
        if self.prompt_field:
            kwargs[self.prompt_field] = prompt.text
        if self._environment_class is not None:
            self._session = self._environment_class()
            return self._opening(_fields(self._session.reset(**_accepted(self._session.reset, kwargs))))
        from openenv.core import GenericEnvClient  # the openenv extra; imported per use

        self._session = GenericEnvClient(base_url=self.base_url, message_timeout_s=self.message_timeout_s).sync()
        self._session.connect()
        return self._opening(_fields(self._session.reset(**kwargs).observation))

    def _opening(self, fields: dict[str, Any]) -> str:
        return self._text(fields) if self.reset_observation else ""

    def step(self, action: Action) -> StepResult:
        if self._session is None:
            raise RuntimeError("openenv: step before reset")
        payload = {self.action_field: action.text}
        if self._action_class is not None:
            observation = self._session.step(self._action_class(**payload))
            fields = _fields(observation)
            reward, done = observation.reward, observation.done
        else:
            result = self._session.step(payload)
            fields, reward, done = _fields(result.observation), result.reward, result.done
        return StepResult(observation=self._text(fields), reward=float(reward or 0.0), done=bool(done))

    def _text(self, fields: dict[str, Any]) -> str:
        if not self.observation_field:
            return ""
        if self.observation_field not in fields:
            raise KeyError(
                f"openenv: the observation has no field {self.observation_field!r} (it has {sorted(fields)})"
            )
        return str(fields[self.observation_field])

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and self._environment_class is None:
            session.close()


def _accepted(method: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``kwargs`` ``method`` takes (OpenEnv's server passes a reset only what its
    signature names; an environment without ``seed`` is not seeded)."""
    parameters = inspect.signature(method).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


def _fields(observation: Any) -> dict[str, Any]:
    """An OpenEnv observation (a pydantic model in process, a dict from a server) as a dict."""
    if isinstance(observation, dict):
        return observation
    dump = getattr(observation, "model_dump", None)
    return dict(dump()) if callable(dump) else dict(vars(observation))
