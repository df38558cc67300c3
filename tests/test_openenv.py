"""The OpenEnv adapter (``echo2.envs.openenv``) against a real OpenEnv environment.

The environment is the one OpenEnv's own CLI makes (``openenv init echo_env``: the
package's template, an echo environment whose reward is 0.1 per character echoed). It is
run two ways, as a user would: in this process (its server-side class), and behind
OpenEnv's own server (FastAPI + uvicorn on 127.0.0.1) reached through OpenEnv's own client
(``GenericEnvClient``, a WebSocket session per episode). Episodes are played through
echo2's episode loop and, in process, replayed as the Rewarder replays them.

Needs the ``openenv`` extra (``pip install 'echo2[openenv]'``: ``openenv-core`` with its
server stack, which is heavy: gradio, fastmcp; not installed by bootstrap). Without it
these tests skip.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "openenv.core.env_server.http_server",
    reason="the openenv extra is not installed (pip install 'echo2[openenv]' installs openenv-core)",
)

from tests.ports import port_bases
from tests.test_envs import CODEC, PROMPT, SEED, TOKENIZER, group_of, scripted

from echo2.envs.base import load_environment
from echo2.envs.episode import ENVIRONMENT, EpisodeLimits, Segment
from echo2.envs.play import EpisodeRequest, Played, play_episodes
from echo2.envs.replay import ReplayMismatch, episode_segments, replay_episode
from echo2.tasks.calls import TimedCalls

pytestmark = pytest.mark.timeout(120)

LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=23, max_new_tokens=5)
ECHO = {
    "environment": "echo_env.server.echo_env_environment:EchoEnvironment",
    "action": "echo_env.models:EchoAction",
    "action_field": "message",
    "observation_field": "echoed_message",
    "reset_observation": False,  # its greeting is text the tiny model's alphabet lacks
}


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The echo environment OpenEnv's CLI makes, importable as ``echo_env``."""
    root = tmp_path_factory.mktemp("openenv")
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env"], cwd=root, check=True, capture_output=True)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))


def play(kwargs: dict[str, object], n: int) -> list[Played]:
    import asyncio

    spec = load_environment("openenv", kwargs)
    requests = [EpisodeRequest(group=0, prompt=PROMPT, prompt_ids=TOKENIZER.encode_prompt(PROMPT.text), seed=SEED)] * n
    calls = TimedCalls(2, name="openenv")
    try:
        return asyncio.run(
            play_episodes(
                requests, factory=spec.factory, generate=scripted(lambda context, length: "975"), codec=CODEC,
                limits=LIMITS, calls=calls, timeout_s=30.0, temperature=1.0, top_p=1.0, version=lambda: 0,
            )
        )  # fmt: skip
    finally:
        calls.close()


def test_an_openenv_class_in_process_plays_and_replays(echo_env: Path) -> None:
    spec = load_environment("openenv", ECHO)
    assert spec.replayable  # a class in this process: the trusted side can run it too
    played = play(ECHO, n=2)
    for p in played:
        assert p.failure is None, p.failure
        texts = [TOKENIZER.decode(s.ids) for s in p.episode.segments()]
        # each action is echoed back as the next observation
        assert texts == ["975", "975", "975", "975", "975"]
        assert p.episode.returns == pytest.approx(0.3 * 3) and p.episode.ended_by == "max_turns"
    group = group_of(played)
    for i in range(2):
        replayed = replay_episode(spec.factory, PROMPT, SEED, episode_segments(group, i), CODEC, LIMITS)
        assert replayed.returns == pytest.approx(0.9)
    honest = episode_segments(group, 0)
    forged = [honest[0], Segment(honest[1].ids[::-1].copy(), ENVIRONMENT), *honest[2:]]
    with pytest.raises(ReplayMismatch):
        replay_episode(spec.factory, PROMPT, SEED, forged, CODEC, LIMITS)


@pytest.fixture
def echo_server(echo_env: Path) -> Iterator[str]:
    """OpenEnv's server for the echo environment, on 127.0.0.1 (the template's app)."""
    (base,) = port_bases(1, span=1)
    url = f"http://127.0.0.1:{base}"
    log = echo_env / f"server-{base}.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "echo_env.server.app:app", "--host", "127.0.0.1", "--port", str(base)],
            cwd=echo_env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # the server's own health endpoint says when it serves
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the OpenEnv server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_an_openenv_server_through_its_client_plays_as_the_class_does(echo_server: str) -> None:
    remote = {"base_url": echo_server, "observation_field": "echoed_message", "reset_observation": False}
    spec = load_environment("openenv", remote)
    assert not spec.replayable  # a service: accepted only from trusted samplers
    (p,) = play(remote, n=1)  # the template's server admits one session at a time
    assert p.failure is None, p.failure
    (local,) = play(ECHO, n=1)
    assert p.episode.tokens == local.episode.tokens and p.episode.returns == pytest.approx(local.episode.returns)


def test_a_server_that_is_gone_fails_the_episode_not_the_sampler() -> None:
    (base,) = port_bases(1, span=1)  # nothing listens there
    (p,) = play({"base_url": f"http://127.0.0.1:{base}", "observation_field": "echoed_message"}, n=1)
    assert p.failure is not None and p.failure.reason == "environment_raised"
    assert "ConnectionError" in p.failure.detail
