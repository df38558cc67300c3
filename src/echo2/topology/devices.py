"""The GPUs a launcher can hand out: what ``[processes.NAME] gpus = [...]`` indexes into.

``gpus`` lists indices among the devices the launcher itself sees: its own
``CUDA_VISIBLE_DEVICES`` when set (a batch scheduler's allocation: ``gpus = [0, 1]`` under
``CUDA_VISIBLE_DEVICES=4,5`` gives the process physical GPUs 4 and 5), else every GPU
``nvidia-smi`` lists. A process is started with ``CUDA_VISIBLE_DEVICES`` set to its share, so
its CUDA device 0 is its first listed GPU and torchrun's local rank ``i`` uses its ``i``-th.

``ECHO2_ASSUME_GPUS=N`` makes the launcher take N GPUs as given without looking: for
checking (``--dry-run``) a topology meant for another machine, on one that has fewer. The
launcher prints a note saying so. NVIDIA devices only (``nvidia-smi``, ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

ASSUME_GPUS_ENV = "ECHO2_ASSUME_GPUS"
"""Environment variable: take this many GPUs as present instead of asking ``nvidia-smi``."""
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
_QUERY_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class HostGPUs:
    """The devices this launcher hands out: ``ids[i]`` is what ``gpus = [i]`` becomes."""

    ids: tuple[str, ...]
    """Entries of the children's ``CUDA_VISIBLE_DEVICES``, by index of ``gpus``."""
    source: str
    """Where they came from, for messages: ``nvidia-smi``, ``CUDA_VISIBLE_DEVICES=4,5``, ..."""
    assumed: bool = False
    """Taken from ``ECHO2_ASSUME_GPUS`` without looking at the machine."""

    def visible(self, gpus: list[int] | tuple[int, ...]) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value of a process given ``gpus`` (checked to exist)."""
        return ",".join(self.ids[g] for g in gpus)


def probe_host_gpus(environ: dict[str, str] | None = None) -> HostGPUs:
    """The GPUs of this machine that this process may hand out (see the module docstring).

    Raises ``ValueError`` for an ``ECHO2_ASSUME_GPUS`` that is not a count."""
    env = os.environ if environ is None else environ
    assumed = env.get(ASSUME_GPUS_ENV, "").strip()
    if assumed:
        if not assumed.isdigit():
            raise ValueError(f"{ASSUME_GPUS_ENV}={assumed!r}: expected a number of GPUs")
        return HostGPUs(tuple(str(i) for i in range(int(assumed))), f"{ASSUME_GPUS_ENV}={assumed}", assumed=True)
    count, source = _nvidia_smi_count()
    if count == 0:
        return HostGPUs((), source)
    visible = env.get(VISIBLE_ENV)
    if visible is None:
        return HostGPUs(tuple(str(i) for i in range(count)), f"nvidia-smi: {count} GPU(s)")
    # CUDA stops at the first entry that is not a device ("-1", "" hide everything after them).
    ids: list[str] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        ids.append(entry)
    return HostGPUs(tuple(ids), f"{VISIBLE_ENV}={visible}")


def _nvidia_smi_count() -> tuple[int, str]:
    """(GPUs ``nvidia-smi`` lists, what was found) — (0, why) without a working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0, "nvidia-smi is not on PATH"
    try:
        done = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_QUERY_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"nvidia-smi failed: {exc}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return 0, f"nvidia-smi exited {done.returncode}" + (f": {why[0]}" if why else "")
    return sum(1 for line in done.stdout.splitlines() if line.strip()), "nvidia-smi"


__all__ = ["ASSUME_GPUS_ENV", "VISIBLE_ENV", "HostGPUs", "probe_host_gpus"]
