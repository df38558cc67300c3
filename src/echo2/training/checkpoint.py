"""Learner checkpoints that verify: each file's digest in a manifest, written atomically.

A checkpoint is a directory ``checkpoints/step_NNNNNN/`` (the path: ``echo2.rundir``) with the
trainer's files (``model.safetensors``, ``optimizer.pt``), ``trained_tasks.json``, and
``manifest.json``: the step, version and incarnation it continues from, and the size and
BLAKE3 digest of every other file (BLAKE3, as the weights on the wire).

Writing (:func:`write_checkpoint`): the files go into ``checkpoints/.tmp-step_NNNNNN/``, each
is fsynced, the manifest is written last, the directory is fsynced and renamed into place,
and ``checkpoints/`` is fsynced. The manifest is the commit mark: a ``step_*`` directory
without one was never completed (or was damaged). A crash leaves at most a ``.tmp-`` or
``.old-`` directory behind, which no reader lists and the next write of that step clears.

Reading (:func:`newest_good_checkpoint`): newest first, the first checkpoint whose manifest
parses and whose files all have their size and digest; each one passed over is named in one
line with what is wrong (a file missing, truncated, or with another digest; no manifest).

The previous format (``state.json`` written last, no digests) still resumes: runs in it
exist, they were complete by that format's contract, and refusing them would send those
runs back to step 0. With no digest to check, such a checkpoint is accepted when its files
read back (``state.json`` parses, the safetensors and optimiser files load), and the log
says it was not verified.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import blake3
import msgspec
from safetensors import SafetensorError

from echo2.errors import CheckpointInvalid, one_line

MANIFEST_FILE = "manifest.json"
LEGACY_STATE_FILE = "state.json"
"""The previous format's commit mark (step, version, incarnation; no digests)."""
TRAINED_TASKS_FILE = "trained_tasks.json"
MANIFEST_FORMAT = 1
_STAGING_PREFIX = ".tmp-"
_REPLACED_PREFIX = ".old-"


class FileDigest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    size: int
    """Bytes."""
    blake3: str
    """Hex BLAKE3 digest of the whole file."""


class CheckpointState(msgspec.Struct, frozen=True):
    """Where the learner stood when it wrote the checkpoint."""

    step: int
    version: int
    incarnation: int
    """The incarnation that wrote it (a resume takes a newer one)."""


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    state: CheckpointState
    files: dict[str, FileDigest]
    """Every other file under the directory, by its path relative to it (``/``-separated)."""


_manifest_decoder = msgspec.json.Decoder(Manifest)
_legacy_decoder = msgspec.json.Decoder(CheckpointState)


def file_digest(path: Path) -> FileDigest:
    """Size and BLAKE3 of a file, read through mmap (no copy of a large model in memory)."""
    size = path.stat().st_size
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if size:  # an empty file cannot be mapped
        hasher.update_mmap(path)
    return FileDigest(size=size, blake3=hasher.hexdigest())


# -- writing ----------------------------------------------------------------------------


def write_checkpoint(directory: Path, state: CheckpointState, fill: Callable[[Path], None]) -> Path:
    """Write a checkpoint at ``directory`` atomically; returns ``directory``.

    ``fill(staging)`` writes the checkpoint's files into an empty staging directory; they
    are digested, fsynced and committed by the manifest and the rename. A checkpoint already
    at ``directory`` (the final checkpoint at a periodic one's step, or a damaged one a
    resume passed over) is replaced."""
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f"{_STAGING_PREFIX}{directory.name}"
    replaced = parent / f"{_REPLACED_PREFIX}{directory.name}"
    for leftover in (staging, replaced):  # from a writer killed mid-way
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir()
    fill(staging)
    if (staging / MANIFEST_FILE).exists():
        raise CheckpointInvalid(f"the trainer wrote {MANIFEST_FILE}, the checkpoint's own file")
    files: dict[str, FileDigest] = {}
    for path in sorted(staging.rglob("*")):  # save_pretrained may write subdirectories
        if path.is_dir():
            _fsync_dir(path)
            continue
        _fsync_file(path)
        files[path.relative_to(staging).as_posix()] = file_digest(path)
    manifest = Manifest(format=MANIFEST_FORMAT, state=state, files=files)
    with open(staging / MANIFEST_FILE, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(manifest)))
        out.flush()
        os.fsync(out.fileno())
    _fsync_dir(staging)
    if directory.exists():
        directory.rename(replaced)
    staging.rename(directory)
    _fsync_dir(parent)
    shutil.rmtree(replaced, ignore_errors=True)
    return directory


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ----------------------------------------------------------------------------


def verify_checkpoint(directory: Path) -> CheckpointState:
    """The state of a checkpoint whose every file is as its manifest says.

    Raises ``CheckpointInvalid`` with a one-line reason otherwise. A checkpoint of the
    previous format (no manifest, ``state.json``) is checked by reading its files."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        if (directory / LEGACY_STATE_FILE).is_file():
            return _read_legacy(directory)
        raise CheckpointInvalid(f"no {MANIFEST_FILE} (never completed, or damaged)")
    try:
        manifest = _manifest_decoder.decode(manifest_path.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise CheckpointInvalid(f"{MANIFEST_FILE} unreadable: {one_line(exc)}") from None
    if manifest.format != MANIFEST_FORMAT:
        raise CheckpointInvalid(f"{MANIFEST_FILE} has format {manifest.format}, this echo2 reads {MANIFEST_FORMAT}")
    for name, expected in manifest.files.items():
        path = directory / name
        try:
            found = file_digest(path)
        except FileNotFoundError:
            raise CheckpointInvalid(f"{name} is missing") from None
        except OSError as exc:
            raise CheckpointInvalid(f"{name} unreadable: {one_line(exc)}") from None
        if found.size != expected.size:
            raise CheckpointInvalid(f"{name} has {found.size} bytes, the manifest says {expected.size}")
        if found.blake3 != expected.blake3:
            raise CheckpointInvalid(f"{name} does not match its digest")
    return manifest.state


def _read_legacy(directory: Path) -> CheckpointState:
    import torch
    from safetensors.torch import load_file

    from echo2.training.trainer import OPTIMIZER_FILE, WEIGHTS_FILE

    try:
        state = _legacy_state(directory)
        load_file(directory / WEIGHTS_FILE)
        if (directory / OPTIMIZER_FILE).is_file():
            torch.load(directory / OPTIMIZER_FILE, weights_only=True)
        if (directory / TRAINED_TASKS_FILE).is_file():
            json.loads((directory / TRAINED_TASKS_FILE).read_text())
    except FileNotFoundError as exc:
        raise CheckpointInvalid(f"{Path(exc.filename).name} is missing") from None
    except (
        OSError,
        ValueError,
        msgspec.DecodeError,
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
        SafetensorError,
    ) as exc:
        # json raises ValueError; torch.load raises RuntimeError or EOFError on a cut file,
        # UnpicklingError on garbage.
        raise CheckpointInvalid(f"unreadable ({type(exc).__name__}: {one_line(exc)})") from None
    return state


def newest_good_checkpoint(
    directories: Sequence[Path], warn: Callable[[str], None]
) -> tuple[Path, CheckpointState] | None:
    """The newest of ``directories`` (oldest first, as ``RunDir.checkpoint_dirs``) that
    verifies, and its state; ``warn`` gets one line per checkpoint passed over, and one for
    a checkpoint of the previous format. None when none verifies."""
    for directory in reversed(directories):
        try:
            state = verify_checkpoint(directory)
        except CheckpointInvalid as exc:
            warn(f"--resume: checkpoint {directory.name} is damaged ({exc}); trying the one before")
            continue
        if not (directory / MANIFEST_FILE).is_file():
            warn(f"--resume: checkpoint {directory.name} has no digests (previous format): its files read back")
        return directory, state
    return None


def newest_incarnation(directories: Sequence[Path]) -> int:
    """The highest incarnation any checkpoint names, damaged ones included (0 if none says):
    a resume must order after every incarnation that ran, not just the one it resumes from."""
    newest = 0
    for directory in directories:
        for read in (_manifest_state, _legacy_state):
            try:
                newest = max(newest, read(directory).incarnation)
                break
            except (OSError, msgspec.DecodeError):
                continue  # absent or damaged: the other format's file may say
    return newest


def _manifest_state(directory: Path) -> CheckpointState:
    return _manifest_decoder.decode((directory / MANIFEST_FILE).read_bytes()).state


def _legacy_state(directory: Path) -> CheckpointState:
    return _legacy_decoder.decode((directory / LEGACY_STATE_FILE).read_bytes())
