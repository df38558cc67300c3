"""Preflight: what a validated topology's values refer to, checked before anything starts.

The schema (``echo2.topology.schema``) decodes each table on its own: types, bounds,
enumerated values, names that stand for code. ``check_before_launch(topology, processes)``
checks what needs more than one table, or this machine, so that a topology that cannot run
stops the launcher (``--dry-run`` included) with one line naming the field and exit 2,
before any process starts, not later with a traceback inside a child:

* the job's task: it builds with its ``task_kwargs`` (a dataset file exists, loads, has the
  mapped fields and a non-empty held-out split; user modules it names import), and every
  prompt it will issue encodes with the model's tokenizer (``tasks.base.prompts_to_check``:
  all of a dataset's rows, a sample of an endless stream), the tokenizer loaded alone,
  without the model's weights;
* relations that cannot work: a Buffer, a PromptSource window or a task budget smaller
  than one learner batch (``job.groups_per_step``): no step could ever be trained; a
  learner's masked-IS band with ``mask_low >= mask_high``;
* addresses (``echo2.topology.addresses``, derived once here as ``resolve`` will): a
  cross-host binder on a loopback address, tcp ports past 65535 or clashing on one machine;
  and the tcp ports this launcher's processes bind must be free here (a note when they lie
  in the kernel's ephemeral range, where any outgoing connection may take one);
* GPUs: the ``gpus`` of each process this launcher starts exist among the devices it sees
  (``echo2.topology.devices``; on a machine without GPUs, any ``gpus`` fails here, unless
  ``ECHO2_ASSUME_GPUS`` says how many to take as given); a note when processes share one;
* for the processes this launcher starts (``processes``), what must exist on this machine:
  each sampler's engine and its ``engine_kwargs`` against the engine's signature, the model
  directory (``job.model`` or the engine's ``model_dir``), shared-memory directories, manifest signing and verification keys, and with CURVE on the
  key files each process loads (``CurveSettings.load``) and the server keys it pins.

Processes on other hosts are checked by their own host's launcher (``--host``): their files
and GPUs live there. A process this launcher starts as a node > 0 of a multi-node torchrun
(``followers``) is checked for its GPUs and model only: its ports are bound on node 0. A
learner's ``device`` is checked for its form (``echo2.config.Device``); only ``gpus`` is
checked against the machine.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

from echo2.actors.buffer import BufferConfig
from echo2.actors.learner import LearnerConfig
from echo2.actors.prompt_source import PromptSourceConfig
from echo2.actors.sampler import SamplerConfig
from echo2.actors.weight_publisher import WeightPublisherConfig
from echo2.config import check_kwargs
from echo2.errors import ConfigError, ResolveError, one_line
from echo2.job import JobConfig, PromptFormat
from echo2.models.adapters import LoraConfig, check_targets
from echo2.models.location import is_hf_spec, load_prompt_tokenizer, locate_model
from echo2.observe.writers import check_writers_available
from echo2.registry import ENGINES
from echo2.tasks.base import Task, load_job_task, prompts_to_check
from echo2.topology.addresses import Addresses, topology_addresses
from echo2.topology.devices import ASSUME_GPUS_ENV, HostGPUs
from echo2.topology.schema import PlacedActor, Topology
from echo2.transport.auth import CurveSettings, load_public_keys

_MODEL_ENGINES = ("torch", "hf", "vllm")
"""Engines that load a model: the Sampler gives them ``seed`` and ``model_dir`` by default."""
_T = TypeVar("_T")


def check_before_launch(
    topology: Topology,
    processes: Sequence[str],
    *,
    followers: Collection[str] = (),
    host_gpus: HostGPUs | None = None,
) -> list[str]:
    """Raise ``ConfigError`` (one line, naming the field) if ``topology`` cannot run.

    ``processes``: those this launcher starts; what must exist on this machine is checked
    for them only. ``followers``: those of them it starts as a node > 0 of a multi-node
    torchrun. ``host_gpus``: this machine's GPUs (``probe_host_gpus``), needed when one of
    ``processes`` lists ``gpus``. Returns notes on checks that could not be made or on
    choices worth a second look (to print, not to fail on).
    """
    check_relations(topology)
    addresses = topology_addresses(topology, "preflight")
    local = set(processes) - set(followers)
    notes = check_gpus(topology, processes, host_gpus)
    for actor in topology.actors.values():
        if actor.process in local:
            _check_on_this_host(actor, topology.job)
            if topology.run.metric_writers and actor.cls.completes_run and actor.cls.trusted:  # the learner's process
                check_writers_available(topology.run.metric_writers)
        elif actor.process in followers and isinstance(actor.config, LearnerConfig):
            _check_model(topology.job.model, "job.model")  # every rank builds the model
    if topology.security.curve:
        _check_curve(topology, addresses, local)
    notes += _check_tcp_ports(topology, addresses, local)
    return notes + check_job(topology.job)


def check_gpus(topology: Topology, processes: Sequence[str], host_gpus: HostGPUs | None) -> list[str]:
    """Each process's ``gpus`` exist among ``host_gpus``; notes on GPUs shared or assumed."""
    asking = [name for name in processes if topology.processes[name].gpus]
    if not asking:
        return []
    if host_gpus is None:
        raise ValueError("check_gpus: processes ask for GPUs and host_gpus was not probed")
    for name in asking:
        gpus = topology.processes[name].gpus
        if not host_gpus.ids:
            raise ConfigError(
                f"asks for GPU(s) {', '.join(map(str, gpus))} but this machine has none ({host_gpus.source}); "
                f"start it on its GPU host (--host), or set {ASSUME_GPUS_ENV}=N to check it for a machine with N",
                path=f"processes.{name}.gpus",
            )
        missing = [g for g in gpus if g >= len(host_gpus.ids)]
        if missing:
            raise ConfigError(
                f"GPU {missing[0]} is not among the {len(host_gpus.ids)} this machine's launcher sees "
                f"({host_gpus.source}): indices 0-{len(host_gpus.ids) - 1}",
                path=f"processes.{name}.gpus",
            )
    notes = []
    if host_gpus.assumed:
        notes.append(f"gpus: checked against {host_gpus.source}, not against this machine's devices")
    holders: dict[int, list[str]] = {}
    for name in asking:
        for gpu in topology.processes[name].gpus:
            holders.setdefault(gpu, []).append(name)
    for gpu, names in sorted(holders.items()):
        if len(names) > 1:
            notes.append(
                f"gpus: GPU {gpu} is shared by processes {', '.join(names)}; each takes memory on it "
                "(a vLLM engine its gpu_memory_utilization, up front): leave room for the others"
            )
    return notes


def check_relations(topology: Topology) -> None:
    """Settings of different tables that together cannot train a single step."""
    job = topology.job
    batch = f"one learner batch (job.groups_per_step = {job.groups_per_step})"
    for actor in topology.actors.values():
        config, where = actor.config, f"actors.{actor.spec}.config"
        if isinstance(config, BufferConfig) and config.max_groups < job.groups_per_step:
            raise ConfigError(
                f"{config.max_groups} is less than {batch}: no batch could ever be served",
                path=f"{where}.max_groups",
            )
        if isinstance(config, LearnerConfig) and config.mask_low >= config.mask_high:
            raise ConfigError(
                f"{config.mask_high:g} is not above mask_low = {config.mask_low:g}: the masked-IS band is empty",
                path=f"{where}.mask_high",
            )
        if isinstance(config, LearnerConfig) and config.lora is not None:
            _check_lora(topology, actor, config.lora)
        if isinstance(config, PromptSourceConfig):
            if 0 < config.max_inflight_groups < job.groups_per_step:
                raise ConfigError(
                    f"{config.max_inflight_groups} is less than {batch}: the window could never fill one",
                    path=f"{where}.max_inflight_groups",
                )
            if 0 < config.max_tasks < job.groups_per_step:
                raise ConfigError(
                    f"{config.max_tasks} tasks are fewer than {batch}: no step could be trained",
                    path=f"{where}.max_tasks",
                )


def _check_lora(topology: Topology, learner: PlacedActor, lora: LoraConfig) -> None:
    """A LoRA learner trains on one process, and every vLLM sampler must be able to load its
    adapters (vLLM fixes the largest rank when it starts)."""
    if learner.cls.kind != "learner":
        raise ConfigError(
            f"LoRA training runs on the single-process learner, not on kind {learner.kind!r}",
            path=f"actors.{learner.spec}.config.lora",
        )
    for actor in topology.actors.values():
        config = actor.config
        if isinstance(config, SamplerConfig) and config.engine == "vllm":
            rank = config.engine_kwargs.get("max_lora_rank", 0)
            if not isinstance(rank, int) or rank < lora.rank:
                raise ConfigError(
                    f"the learner trains LoRA adapters of rank {lora.rank} (actors.{learner.spec}.config.lora.rank): "
                    f"the vllm engine must start with max_lora_rank >= {lora.rank}, got {rank!r}",
                    path=f"actors.{actor.spec}.config.engine_kwargs.max_lora_rank",
                )


def _check_on_this_host(actor: PlacedActor, job: JobConfig) -> None:
    config, where = actor.config, f"actors.{actor.spec}.config"
    if isinstance(config, SamplerConfig):
        _check_engine(config, job, where)
        if config.shm_dir:
            _check_directory(config.shm_dir, f"{where}.shm_dir")
        if config.manifest_verify_key:
            from echo2.weights.signing import ManifestVerifier

            _with_path(f"{where}.manifest_verify_key", ManifestVerifier, config.manifest_verify_key)
    elif isinstance(config, LearnerConfig):
        _check_model(job.model, "job.model")
        if config.lora is not None:
            try:
                check_targets(job.model, config.lora)
            except ValueError as exc:
                raise ConfigError(one_line(exc), path=f"{where}.lora.target_modules") from None
    elif isinstance(config, WeightPublisherConfig):
        if config.shm_dir:
            _check_directory(config.shm_dir, f"{where}.shm_dir")
        if config.signing_key:
            from echo2.weights.signing import ManifestSigner

            _with_path(f"{where}.signing_key", ManifestSigner, config.signing_key)


def _check_engine(config: SamplerConfig, job: JobConfig, where: str) -> None:
    """The engine the Sampler will build (``Sampler.setup``), called as it will call it."""
    kind, kwargs = config.engine, dict(config.engine_kwargs)
    for own in ("prompt_format", "chat_template"):
        if own in kwargs:
            raise ConfigError(
                "prompts are rendered as job.prompt_format says, the same for every engine and the trusted side "
                "that checks their ids; set it there",
                path=f"{where}.engine_kwargs.{own}",
            )
    if kind in _MODEL_ENGINES:
        model = kwargs.get("model_dir", job.model)
        _check_model(str(model), f"{where}.engine_kwargs.model_dir" if "model_dir" in kwargs else "job.model")
        if not kwargs:
            # The Sampler's own seed and model_dir fit every model engine; importing one to
            # check just them would cost the launcher a torch import (seconds) per run.
            return
        if kind == "torch" and is_hf_spec(job.model):
            kind = "hf"  # the Sampler runs a Hugging Face model on the hf engine
        kwargs.setdefault("seed", 0)
        if job.model:
            kwargs.setdefault("model_dir", job.model)
    try:
        engine = ENGINES.resolve(kind, callable, "an echo2 Engine class")
    except ResolveError as exc:
        raise ConfigError(str(exc), path=f"{where}.engine") from None
    check_kwargs(engine, kwargs, f"{where}.engine_kwargs", name=f"engine {kind!r}")


def _check_model(spec: str, path: str) -> None:
    """The rule of ``echo2.models.location.locate_model``, without loading anything."""
    try:
        locate_model(spec)
    except ValueError as exc:
        raise ConfigError(str(exc), path=path) from None


def _check_directory(directory: str, path: str) -> None:
    if not Path(directory).is_dir():
        raise ConfigError(f"{directory!r} is not a directory on this machine", path=path)


def _check_curve(topology: Topology, addresses: Addresses, local: set[str]) -> None:
    """Each local process's CURVE material, loaded as its child will load it."""
    security = topology.security
    if security.allowed:  # else <keys_dir>/allowed, a part of keys_dir
        _with_path("security.allowed", load_public_keys, security.allowed)
    for process in sorted(local):
        host = topology.processes[process].host
        settings = _with_path(
            "security.keys_dir", CurveSettings.load, security.keys_dir, host, topology.hosts, security.allowed
        )
        for actor in topology.actors_in(process):
            for port, urls in addresses.ports[actor.name].items():
                _with_path("security.keys_dir", settings.for_port, urls)  # every server's public key
                if urls.curve_server and not settings.allowed:
                    allowed = ", ".join(security.allowed) or f"{security.keys_dir}/allowed"
                    raise ConfigError(
                        f"no public key in {allowed}: no peer could connect to {actor.name}.{port}",
                        path="security.allowed",
                    )
        telemetry = addresses.telemetry.get(process, ())
        servers = [addresses.curve_hosts.get(url, "") for url in telemetry]
        _with_path("security.keys_dir", settings.for_urls, False, telemetry, servers)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _check_tcp_ports(topology: Topology, addresses: Addresses, local: set[str]) -> list[str]:
    """The tcp ports local processes bind are free; a note per host whose ports lie in the
    ephemeral range (an outgoing connection there can take one between this check and bind)."""
    by_host: dict[str, list[int]] = {}
    for (actor, port_name), port in sorted(addresses.tcp_ports.items()):
        placed = topology.actors[actor]
        if placed.process not in local:
            continue
        host = topology.processes[placed.process].host
        by_host.setdefault(host, []).append(port)
        _check_free(port, f"{actor}.{port_name}", f"hosts.{host}.port_base", "port_base")
    for host in sorted({topology.processes[process].host for process in local}):
        if join_port := topology.hosts[host].join_port:  # this launcher answers joins there
            _check_free(join_port, "the join port", f"hosts.{host}.join_port", "join_port")
    notes = []
    ephemeral = _ephemeral_range()
    for host, ports in sorted(by_host.items()):
        if ephemeral and min(ports) <= ephemeral[1] and ephemeral[0] <= max(ports):
            notes.append(
                f"hosts.{host}.port_base: tcp ports {min(ports)}-{max(ports)} lie in this machine's ephemeral range "
                f"{ephemeral[0]}-{ephemeral[1]} (net.ipv4.ip_local_port_range), where an outgoing connection may "
                f"take one; a base below {ephemeral[0]} avoids that"
            )
    return notes


def _check_free(port: int, what: str, path: str, field: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # libzmq's listener sets SO_REUSEADDR: a port in TIME_WAIT is free for it too.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            why = "is in use on this machine" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise ConfigError(
                f"tcp port {port} ({what}) {why}; stop what holds it or move {field}", path=path
            ) from None


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        low, high = EPHEMERAL_RANGE_FILE.read_text().split()
    except (OSError, ValueError):
        return None  # not Linux, or no procfs: nothing to warn about
    return int(low), int(high)


def _with_path(path: str, load: Callable[..., _T], *args: Any) -> _T:
    """``load(*args)``; its ``ConfigError`` (raised without a field path) given ``path``."""
    try:
        return load(*args)
    except ConfigError as exc:
        raise ConfigError(one_line(exc), path=path) from None


__all__ = ["check_before_launch", "check_gpus", "check_relations"]


def check_job(job: JobConfig) -> list[str]:
    """Build the job's task and encode its prompts; the notes to print (checks not made).

    Raises ``ConfigError`` (``job.task_kwargs: ...``, ``job.model: ...``) on the first failure.
    """
    try:
        task = load_job_task(job)
    except ResolveError as exc:  # a reward or predicate the task names does not import
        raise ConfigError(str(exc), path="job.task_kwargs") from None
    except Exception as exc:  # a user's task factory may fail in any way: report it in one line
        raise ConfigError(f"task {job.task!r}: {one_line(exc)}", path="job.task_kwargs") from None
    notes = check_prompts_encode(task, job.model, job.prompt_format)
    if job.multi_turn:
        check_episodes(job, task)
    return notes


def check_episodes(job: JobConfig, task: Task) -> None:
    """A multi-turn job's environment builds; one that cannot be replayed has trusted
    samplers to come from; on the tiny model, the longest prompt plus ``max_episode_tokens``
    fit its context (else a sampler's engine would fail mid-episode)."""
    from echo2.envs.base import load_environment

    episode = job.episode
    try:
        spec = load_environment(episode.environment, episode.environment_kwargs)
    except ResolveError as exc:
        raise ConfigError(str(exc), path="job.episode.environment_kwargs") from None
    if not spec.replayable and not episode.trusted_samplers:
        raise ConfigError(
            f"environment {episode.environment!r} cannot be replayed by the trusted side, so its episodes are "
            "accepted only from samplers listed here, and none is: no group could ever be trained",
            path="job.episode.trusted_samplers",
        )
    location = locate_model(job.model)
    if location.kind != "tiny" or not location.present:
        return
    context = int(json.loads((location.directory / "config.json").read_text())["max_seq_len"])
    tokenizer = load_prompt_tokenizer(location, job.prompt_format)
    longest = max((len(tokenizer.encode_prompt(p.text)) for p in prompts_to_check(task)), default=0)
    if longest + episode.max_episode_tokens > context:
        raise ConfigError(
            f"{episode.max_episode_tokens} tokens after a prompt of up to {longest} exceed the model's context of "
            f"{context} tokens: at most {context - longest}",
            path="job.episode.max_episode_tokens",
        )


def check_prompts_encode(task: Task, model: str, prompt_format: PromptFormat | None = None) -> list[str]:
    """Encode the task's prompts as ``model``'s tokenizer renders them (``prompt_format``);
    ConfigError at the first that fails, or when the format does not fit the model."""
    try:
        location = locate_model(model)
        if not location.present:
            return [f"job.model: {model!r} is converted on first use; prompts not checked against its tokenizer"]
        tokenizer = load_prompt_tokenizer(location, prompt_format)
    except ValueError as exc:
        where = "job.prompt_format" if "prompt_format" in str(exc) else "job.model"
        raise ConfigError(one_line(exc), path=where) from None
    except (OSError, ImportError) as exc:
        raise ConfigError(f"cannot load the tokenizer: {one_line(exc)}", path="job.model") from None
    for prompt in prompts_to_check(task):
        try:
            tokenizer.encode_prompt(prompt.text)
        except ValueError as exc:
            raise ConfigError(
                f"prompt {prompt.task_id!r} of task {task.name!r} cannot be encoded for model "
                f"{model or 'built-in tiny'!r}: {one_line(exc)}",
                path="job.task",
            ) from None
    return []
