"""Running untrusted program text: a child process with time, memory, file and network limits.

``run_untrusted(source, stdin, limits)`` writes ``source`` to a fresh temporary directory and
runs it with this interpreter in isolated mode (``python -I``: no user site, no
``PYTHONPATH``, no current directory on ``sys.path``) through this file run as a script
(standard library only), which applies the limits to itself and then ``exec``s the program,
so no ``preexec_fn`` runs in the Rewarder's threaded process:

* CPU seconds (``RLIMIT_CPU``) and wall seconds (the parent kills the child's whole process
  group at ``wall_s``: a program that sleeps or forks children uses no CPU);
* address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``), open files (``RLIMIT_NOFILE``),
  processes (``RLIMIT_NPROC``: not enforced for root), no core dumps;
* no network: the child enters a network namespace of its own (``unshare(CLONE_NEWNET)``, as
  root, or with an unprivileged user namespace, ``CLONE_NEWUSER | CLONE_NEWNET``) holding
  only a loopback interface that is down. Where neither is allowed the run fails
  (``SandboxUnavailable``) unless ``network=True``: a reward never runs code with more
  access than it asked for without saying so.

This is a resource sandbox against accidents and the runaway programs a policy writes, not
a security boundary against a determined attacker (the filesystem stays readable): run
rewards for hostile code in a container or VM.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
UNAVAILABLE_EXIT = 97
"""The child's exit code when it cannot isolate itself as asked (message on stderr)."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot apply the limits asked for (no network namespace allowed)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run of untrusted code may use."""

    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    file_size_mb: int = 16
    open_files: int = 64
    processes: int = 64
    network: bool = False

    def argv(self) -> list[str]:
        return [
            f"--cpu-s={self.cpu_s}",
            f"--memory-mb={self.memory_mb}",
            f"--file-size-mb={self.file_size_mb}",
            f"--open-files={self.open_files}",
            f"--processes={self.processes}",
            f"--network={'on' if self.network else 'off'}",
        ]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How an untrusted program ended."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_untrusted(source: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
    """Run ``source`` as a Python program under ``limits``; raises ``SandboxUnavailable``
    when the limits cannot be applied here."""
    limits = limits or Limits()
    with tempfile.TemporaryDirectory(prefix="echo2-sandbox-") as workdir:
        program = Path(workdir) / "program.py"
        program.write_text(source)
        argv = [sys.executable, "-I", str(Path(__file__).resolve()), *limits.argv(), str(program)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        child = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a timeout kills what it forked too
        )
        try:
            stdout, stderr = child.communicate(stdin, timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(child)
            stdout, stderr = child.communicate()
            timed_out = True
        finally:
            _kill_group(child)  # a background grandchild outlives nothing
    if child.returncode == UNAVAILABLE_EXIT and stderr.startswith("echo2 sandbox:"):
        raise SandboxUnavailable(stderr.strip().removeprefix("echo2 sandbox: "))
    return RunResult(returncode=child.returncode, stdout=stdout, stderr=stderr, timed_out=timed_out)


@functools.cache
def check_available(limits: Limits | None = None) -> None:
    """Raise ``SandboxUnavailable`` if ``limits`` cannot be applied on this machine. Once per
    process and limits: every loader of the reward (preflight, each actor building the task)
    asks, and the answer does not change (a failure is not cached, so it is asked again)."""
    limits = limits or Limits()
    result = run_untrusted("print('ok')", limits=dataclasses.replace(limits, wall_s=max(limits.wall_s, 30.0)))
    if result.stdout.strip() != "ok":
        raise SandboxUnavailable(
            f"a trivial program failed in the sandbox (exit {result.returncode}): {result.stderr[-200:]}"
        )


def _kill_group(child: subprocess.Popen[str]) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: every process in it has exited


def _isolate_network() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) == 0:
        return
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        return
    err = ctypes.get_errno()
    sys.stderr.write(
        f"echo2 sandbox: cannot isolate the network ({os.strerror(err)}): neither CAP_SYS_ADMIN nor unprivileged "
        "user namespaces (sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces); "
        "allow the network explicitly (network = true) only if the code is trusted\n"
    )
    sys.exit(UNAVAILABLE_EXIT)


def _child_main(args: list[str]) -> None:
    """Apply the limits to this process, then become the program (``exec``)."""
    *options, program = args
    values = dict(option.removeprefix("--").split("=", 1) for option in options)
    if values["network"] == "off":
        _isolate_network()
    mb = 1 << 20
    cpu_s = int(values["cpu-s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (int(values["memory-mb"]) * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(values["file-size-mb"]) * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(values["open-files"]),) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (int(values["processes"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.execv(sys.executable, [sys.executable, "-I", program])


if __name__ == "__main__":
    _child_main(sys.argv[1:])
