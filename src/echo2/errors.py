"""The exceptions echo2 raises, one tree so that callers can catch at the right depth.

::

    Echo2Error                      anything echo2 raises on purpose
    ├── ConfigError                 a topology or option is invalid (one line, names the field)
    │   └── ResolveError            a kind, task or reward name does not resolve (also a ValueError)
    ├── DecodeError                 bytes off the wire are not a valid echo2 message
    │   └── ProtocolMismatch        a peer speaks another PROTOCOL_VERSION
    ├── TransportError              a socket could not be opened, bound or used
    │   └── ClosedError             the endpoint was closed by this process
    ├── CheckpointInvalid           a learner checkpoint is incomplete or damaged (one line: what)
    ├── JournalDamaged              an actor's write-ahead log or snapshot does not decode (echo2.journal)
    ├── ModelMismatch               a worker's model is not the job's (one line: what differs)
    ├── EndOfStream                 every producer of a channel said it is done (not a failure)
    └── ActorFailed                 an actor's run() raised; carries the actor name

Backend exceptions (``zmq.ZMQError``, msgspec's errors, ``ValueError`` from numpy) are
translated at one boundary each, with ``raise ... from exc`` so the cause stays visible.
"""

from __future__ import annotations


class Echo2Error(Exception):
    """Base of every exception echo2 raises on purpose."""


class ConfigError(Echo2Error):
    """A configuration value is invalid. ``str(err)`` is one line naming the field path."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class ResolveError(ConfigError, ValueError):
    """A registry name or import path names nothing usable: unknown, failing to import, or
    not the right kind of object. Also a ``ValueError``, which ``load_task``, ``load_reward``
    and ``make_engine`` raised for these cases before they shared the registry."""


class DecodeError(Echo2Error):
    """Received frames are not a valid echo2 message; the receiver counts and drops them."""


class ProtocolMismatch(DecodeError):
    """The peer's PROTOCOL_VERSION differs from ours."""


class TransportError(Echo2Error):
    """A socket operation failed for a reason other than a bad message."""


class ClosedError(TransportError):
    """The endpoint was closed by this process."""


class CheckpointInvalid(Echo2Error):
    """A learner checkpoint is incomplete or damaged. ``str(err)`` is one line: what is wrong
    (a file missing, truncated or not matching its digest; no manifest; unreadable)."""


class JournalDamaged(Echo2Error):
    """An actor's write-ahead log or snapshot (``echo2.journal``) does not decode: one line
    naming the file and where. A record cut short by a crash is not this: it is dropped."""


class ModelMismatch(Echo2Error):
    """A worker's engine does not serve the model the job names (``Welcome.model``).
    ``str(err)`` is one line: which of vocab size, tokenizer and architecture differ."""


class EndOfStream(Echo2Error):
    """All producers of a channel have ended it. Raised by ``recv``; ends ``async for``."""


class ActorFailed(Echo2Error):
    """An actor's ``run()`` raised. The original exception is ``__cause__``."""

    def __init__(self, actor: str, exc: BaseException) -> None:
        self.actor = actor
        super().__init__(f"actor {actor!r} failed: {type(exc).__name__}: {exc}")


def one_line(exc: BaseException) -> str:
    """``exc``'s message with its whitespace collapsed (its type's name when it has none):
    the form of every error echo2 reports as one line (configs, checkpoints, datasets)."""
    return " ".join(str(exc).split()) or type(exc).__name__
