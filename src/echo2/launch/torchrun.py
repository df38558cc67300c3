"""Torchrun for a process holding a distributed actor (``distributed_learner``): the launcher's
command for it, and the entry point of each rank.

The launcher (``echo2.launch.supervisor``) starts such a process as (``torchrun_args``)::

    python -m echo2.launch.torchrun agent --nproc-per-node N --nnodes M --max-restarts 0 \\
        (--standalone | --rdzv-backend static --rdzv-endpoint ADDR:PORT --node-rank R) \\
        --log-dir RUN_DIR/logs/NAME.torchrun \\
        -m echo2.launch.torchrun --topology RUN_DIR/topology.resolved.json --process NAME

with ``CUDA_VISIBLE_DEVICES`` set from the process's ``gpus``. ``agent`` is torchrun itself
(``python -m torch.distributed.run`` takes the same options) except that a stop signal ends
it with 128 + the signal's number and one line, not a traceback. The launcher supervises the
agent as it does any process (its exit, its output, no restart for a learner) and stops it
with SIGTERM, which the agent forwards to every rank (SIGKILL to the agent after
``run.drain_timeout_s`` + 5 s, as to any child). By hand, the same command works on its own.

Each rank (``main``):

- dies with the agent (``PR_SET_PDEATHSIG`` SIGKILL): an agent killed outright leaves no rank;
- rank 0 runs the process as the launcher would run it (``echo2.launch.child``): it alone
  reads the topology and binds the actors' ports; on SIGTERM or SIGINT it drains (its final
  evaluation and checkpoint, which every rank joins) and then closes the other ranks;
- ranks > 0 build the same trainer from rank 0's job and config and follow its steps
  (``follower_loop``). They ignore SIGINT, SIGTERM and SIGHUP: rank 0 decides when they stop,
  and a follower that left on the agent's forwarded signal would strand rank 0's collective
  final checkpoint. A rank 0 that dies instead fails their next collective, and the agent
  ends the rest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo2.topology import ResolvedProcess
    from echo2.training.distributed import DistributedTrainer

_PR_SET_PDEATHSIG = 1
_FOLLOWER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MONITOR_INTERVAL_S = 0.5
"""How often the torchrun agent checks its ranks (seconds): how soon a rank's exit is seen."""


def torchrun_args(process: ResolvedProcess, *, node_rank: int = 0, log_dir: Path | None = None) -> list[str]:
    """Arguments after ``python`` that start ``process``'s ranks of node ``node_rank`` under torchrun.

    One node without ``rdzv_endpoint``: ``--standalone`` (a rendezvous on a free local port).
    Otherwise torchrun's static rendezvous at ``rdzv_endpoint`` (node 0 serves it), the node
    rank fixed, so that global rank 0, which runs the actors, is on node 0 (``host``).
    ``log_dir``: where torchrun keeps its per-attempt files (its default is a fresh
    directory under /tmp that nothing removes).
    """
    args = [
        "-m",
        "echo2.launch.torchrun",
        "agent",
        "--nproc-per-node",
        str(process.nproc_per_node),
        "--nnodes",
        str(process.nnodes),
        "--max-restarts",
        "0",  # a learner is never restarted within a run: --resume continues it
        "--monitor-interval",
        str(MONITOR_INTERVAL_S),
    ]
    if process.rdzv_endpoint:
        args += ["--rdzv-backend", "static", "--rdzv-endpoint", process.rdzv_endpoint, "--node-rank", str(node_rank)]
    else:
        args += ["--standalone"]
    if log_dir is not None:
        args += ["--log-dir", str(log_dir)]
    return [*args, "-m", "echo2.launch.torchrun"]


def follower_loop() -> DistributedTrainer:
    """Ranks > 0: build the trainer from rank 0's config, then follow rank 0 until it closes."""
    import msgspec

    from echo2.actors.distributed_learner import DistributedLearnerConfig, distributed_trainer, rank_config
    from echo2.job import JobConfig
    from echo2.training.distributed import broadcast_bytes

    spec = msgspec.json.decode(broadcast_bytes(None))
    job = msgspec.convert(spec["job"], JobConfig)
    config = rank_config(msgspec.convert(spec["config"], DistributedLearnerConfig))
    trainer = distributed_trainer(job, config)
    trainer.follow()
    return trainer


def init_distributed(timeout_s: float = 1800.0) -> None:
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() and os.environ.get("ECHO2_DIST_BACKEND") != "gloo" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    print(
        f"echo2.launch.torchrun: rank {dist.get_rank()} of {dist.get_world_size()} "
        f"(node {os.environ.get('GROUP_RANK', '0')}, local rank {os.environ.get('LOCAL_RANK', '0')}): {backend}, "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
        file=sys.stderr,
        flush=True,
    )


def die_with_parent() -> None:
    """SIGKILL this rank when the torchrun agent that started it dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


def agent_main(argv: Sequence[str]) -> int:
    """torchrun's agent with ``argv`` (its options and the ranks' command); 128 + N when
    stopped by signal N, after its ranks are shut down, without a traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    from echo2.launch import exits
    from echo2.launch.child import LauncherWatch

    watch = LauncherWatch(os.getppid())
    watch.log_path = _process_log(argv)

    stopping: list[int] = []

    def launcher_died(signum: int, frame: object) -> None:
        if stopping:  # once: raised again inside torchrun's shutdown, it would SIGTERM the ranks
            return
        stopping.append(signum)
        watch.move_output_to_log()
        raise SignalException(f"launcher (pid {watch.launcher_pid}) exited", sigval=signal.Signals(signum))

    # When the launcher dies (PR_SET_PDEATHSIG: SIGHUP) our output is a pipe nobody reads;
    # torchrun's own handler then fails writing about it and falls back to SIGTERM for the
    # ranks, cutting rank 0's drain short. Ours first moves the output to the process's log.
    # (torchrun's --signals-to-handle, read from PET_SIGNALS_TO_HANDLE; older torch always
    # handles SIGHUP itself.)
    os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGQUIT"
    signal.signal(exits.LAUNCHER_DIED, launcher_died)
    try:
        torchrun_main(list(argv))
    except SignalException as exc:
        signum = signal.Signals(exc.sigval)
        print(f"echo2.launch.torchrun: agent stopped by {signum.name}; its ranks have exited", file=sys.stderr)
        return 128 + int(signum)
    return 0


def _process_log(argv: Sequence[str]) -> Path | None:
    """``logs/<process>.log`` of the run the ranks' ``--topology`` and ``--process`` name."""
    from echo2.rundir import RunDir
    from echo2.topology import ResolvedTopology

    args = list(argv)
    try:
        topology = Path(args[args.index("--topology") + 1])
        process = args[args.index("--process") + 1]
        return RunDir(Path(ResolvedTopology.load(topology).run_dir)).log_path(process)
    except (ValueError, IndexError, OSError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """``agent ARGS``: torchrun's agent (``agent_main``). Otherwise one rank: rank 0 runs
    ``echo2.launch.child`` with ``argv``; the others follow."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["agent"]:
        return agent_main(argv[1:])
    die_with_parent()
    if os.environ.get("RANK", "0") != "0":  # before the rendezvous: a stop then must not kill us either
        for sig in _FOLLOWER_IGNORES:
            signal.signal(sig, signal.SIG_IGN)
    init_distributed()
    import torch.distributed as dist

    try:
        if dist.get_rank() == 0:
            from echo2.launch.child import main as child_main

            return child_main(argv)
        follower_loop()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] == ["agent"]:
        raise SystemExit(code)  # torchrun's agent: its own exit handlers (log directories) run
    from echo2.launch.exits import exit_process

    exit_process(code)  # a rank, after destroy_process_group: no finalization racing torch's threads
