"""``task = "dataset"``: a user's own rows (JSON lines, CSV, Parquet, saved HF datasets) as a task.

Reading (:func:`read_rows`, by suffix unless ``format`` says): ``.jsonl`` / ``.ndjson`` (one
JSON object a line), ``.json`` (a list of objects, or JSON lines), ``.csv`` (a header row;
every value is text), ``.parquet`` (pyarrow, or the ``datasets`` library) and a directory
saved with ``datasets``' ``save_to_disk`` (``split`` picks one of a ``DatasetDict``). The
standard library reads the first three; the others say which package to install.

Mapping: ``prompt_field`` -> ``Prompt.text`` (must be text), ``answer_field`` -> ``Prompt.answer``
(text as is, anything else as JSON), every other field (or only ``meta_fields``) ->
``Prompt.meta``, which the reward receives.

Rows and ids: a row's key is its ``id_field`` value (unique, checked) or its position
``r<index>`` in the file. A training prompt's id is ``"<name>:<key>@e<epoch>"``: unique within
an epoch and across epochs by construction (the Buffer drops a repeated id as a duplicate),
and the same in every run.

Held-out split: the rows of ``heldout_path``, else the rows whose prompt text hashes
(blake2b, so every process agrees) below ``heldout_fraction``. Hashing the text rather than
the position puts identical prompts on the same side, so the evaluation never scores a
prompt that was trained on. Training never streams a held-out row; with ``heldout_path`` a
held-out prompt that also appears in the training file is an error.

Stream: epoch ``e`` is the training rows shuffled by ``Random(f"{name}-{seed}-{e}")`` (or in
file order with ``shuffle = false``); ``epochs = 0`` streams forever, otherwise the stream
ends after ``epochs`` epochs. ``prompts(seed, start=k)`` starts at the ``k``-th prompt by
arithmetic (epoch ``k // n``, offset ``k % n``), so a resumed PromptSource continues the
epoch where it stopped without replaying it.

Reward and metric: ``reward`` names the training reward (``"exact"``, ``"math_answer"``,
``"math_verify"``, ``"code_tests"`` or ``"module:function"``); ``correct`` names the correctness predicate that held-out pass@1
counts. By default it is the reward itself when that is a built-in binary one; with a custom
reward there is no predicate (pass@1 is not reported) unless ``correct`` names one. Built in
Python (the embedding API), ``reward`` and ``correct`` may be the functions themselves.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from echo2.errors import one_line
from echo2.tasks.base import CorrectFn, Prompt, RewardFn, load_reward, reward_range

FORMATS = ("jsonl", "json", "csv", "parquet", "hf")
"""``format``: how to read ``path`` ("" = from its suffix; a directory is "hf")."""
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_BINARY_REWARDS = ("exact", "math_answer", "math_verify", "code_tests")
"""Built-in rewards that are 0 or 1, so 1 means correct."""


class DatasetError(ValueError):
    """A dataset cannot be used: one line naming the file, and the row or field at fault."""


def read_rows(path: Path, format: str = "", split: str = "train") -> list[dict[str, Any]]:
    """Every row of ``path`` as a dict; :class:`DatasetError` naming the file when it cannot."""
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    kind = format or ("hf" if path.is_dir() else _SUFFIXES.get(path.suffix.lower(), ""))
    if kind not in FORMATS:
        raise DatasetError(
            f"{path}: unknown format (suffixes: {', '.join(_SUFFIXES)}; or give format = one of {FORMATS})"
        )
    try:
        if kind == "jsonl":
            rows = _json_lines(path)
        elif kind == "json":
            text = path.read_text(encoding="utf-8")
            rows = json.loads(text) if text.lstrip().startswith("[") else _json_lines(path)
        elif kind == "csv":
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        elif kind == "parquet":
            rows = _parquet(path)
        else:
            rows = _saved_hf_dataset(path, split)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as exc:
        raise DatasetError(f"{path}: cannot read as {kind}: {one_line(exc)}") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{path}: rows must be objects (a JSON list holds {type(rows).__name__} items)")
    return rows


def _json_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: line {number} is not JSON: {exc.msg}") from exc
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: line {number} is a JSON {type(row).__name__}, not an object")
            rows.append(row)
    return rows


def _parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pass
    else:
        return list(pq.read_table(path).to_pylist())
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow or datasets: pip install datasets") from exc
    return list(datasets.Dataset.from_parquet(str(path)))


def _saved_hf_dataset(path: Path, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as exc:
        raise DatasetError(f"{path}: a saved Hugging Face dataset needs datasets: pip install datasets") from exc
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise DatasetError(f"{path}: not a dataset saved with save_to_disk: {one_line(exc)}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{path}: no split {split!r} (splits: {', '.join(loaded)})")
        loaded = loaded[split]
    return list(loaded)


def _unit_hash(text: str) -> float:
    """``text`` -> [0, 1), the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class DatasetTask:
    """Rows of a file as a task; see the module docstring."""

    def __init__(
        self,
        path: str,
        *,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        id_field: str = "",
        meta_fields: Sequence[str] | None = None,
        heldout_path: str = "",
        heldout_fraction: float = 0.1,
        epochs: int = 0,
        shuffle: bool = True,
        format: str = "",
        split: str = "train",
        reward: str | RewardFn = "exact",
        correct: str | CorrectFn = "",
        name: str = "",
    ) -> None:
        if not 0.0 < heldout_fraction < 1.0:
            raise DatasetError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
        if not isinstance(epochs, int) or epochs < 0:
            raise DatasetError(f"epochs must be an int >= 0 (0 = forever), got {epochs!r}")
        self.path = Path(path).expanduser()
        self.name = name or self.path.stem
        self.epochs = epochs
        self.shuffle = shuffle
        self.prompt_field, self.answer_field, self.id_field = prompt_field, answer_field, id_field
        self.meta_fields = None if meta_fields is None else list(meta_fields)
        self._reward: RewardFn = load_reward(reward)
        self.reward_range = reward_range(self._reward)
        predicate = load_reward(correct) if correct else self._reward if reward in _BINARY_REWARDS else None
        if predicate is not None:
            # An attribute, not a method: a task without a predicate must not have ``correct``.
            self.correct: CorrectFn = lambda prompt, completion: bool(predicate(prompt, completion))
        rows = self._prompts_of(self.path, read_rows(self.path, format, split))
        if heldout_path:
            held_file = Path(heldout_path).expanduser()
            self._heldout = self._prompts_of(held_file, read_rows(held_file, format, split))
            train_texts = {p.text for p in rows}
            leaked = [p for p in self._heldout if p.text in train_texts]
            if leaked:
                raise DatasetError(
                    f"{held_file}: {len(leaked)} held-out prompts also appear in {self.path} "
                    f"(first: {leaked[0].text[:60]!r}); evaluation would score trained prompts"
                )
            self._train = rows
        else:
            self._heldout = [p for p in rows if _unit_hash(p.text) < heldout_fraction]
            self._train = [p for p in rows if _unit_hash(p.text) >= heldout_fraction]
            if not self._heldout:
                raise DatasetError(
                    f"{self.path}: the held-out split is empty (heldout_fraction = {heldout_fraction} of "
                    f"{len(rows)} rows selects none); raise it or give heldout_path"
                )
        if not self._train:
            raise DatasetError(f"{self.path}: no training rows (all {len(rows)} are held out)")

    def _prompts_of(self, path: Path, rows: list[dict[str, Any]]) -> list[Prompt]:
        """Rows -> prompts with ids ``<name>:<key>`` (the stream adds the epoch)."""
        if not rows:
            raise DatasetError(f"{path}: holds no rows")
        out: list[Prompt] = []
        seen: set[str] = set()
        for index, row in enumerate(rows):
            for field_name in filter(None, (self.prompt_field, self.answer_field, self.id_field)):
                if field_name not in row:
                    have = ", ".join(map(str, row)) or "none"
                    raise DatasetError(f"{path}: row {index} has no field {field_name!r} (fields: {have})")
            text = row[self.prompt_field]
            if not isinstance(text, str):
                raise DatasetError(
                    f"{path}: row {index}: field {self.prompt_field!r} is a {type(text).__name__}, not text"
                )
            answer = row[self.answer_field]
            key = str(row[self.id_field]) if self.id_field else f"r{index}"
            if key in seen:
                raise DatasetError(f"{path}: row {index}: id {key!r} (field {self.id_field!r}) repeats an earlier row")
            seen.add(key)
            mapped = {self.prompt_field, self.answer_field, self.id_field}
            if self.meta_fields is None:
                meta = {k: v for k, v in row.items() if k not in mapped}
            else:
                missing = [k for k in self.meta_fields if k not in row]
                if missing:
                    raise DatasetError(f"{path}: row {index} has no field {missing[0]!r} (meta_fields)")
                meta = {k: row[k] for k in self.meta_fields}
            out.append(
                Prompt(
                    task_id=f"{self.name}:{key}",
                    text=text,
                    answer=answer if isinstance(answer, str) else json.dumps(answer, default=str),
                    meta=meta,
                )
            )
        return out

    # -- the Task interface --------------------------------------------------------------

    @property
    def train_size(self) -> int:
        return len(self._train)

    def epoch_order(self, seed: int, epoch: int) -> list[int]:
        """Indices of the training rows in epoch ``epoch``'s order for ``seed``."""
        order = list(range(len(self._train)))
        if self.shuffle:
            random.Random(f"{self.name}-{seed}-{epoch}").shuffle(order)
        return order

    def prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Training prompts, epoch after epoch, from the ``start``-th (see the module docstring)."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        n = len(self._train)
        epoch, offset = divmod(start, n)
        while not self.epochs or epoch < self.epochs:
            order = self.epoch_order(seed, epoch)
            for index in order[offset:]:
                row = self._train[index]
                yield Prompt(f"{row.task_id}@e{epoch}", row.text, row.answer, row.meta)
            epoch, offset = epoch + 1, 0

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` held-out rows in file order (all of them when there are fewer)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self._heldout[:n]

    def every_prompt(self) -> list[Prompt]:
        """Every training and held-out row once (checked by the launcher before a run)."""
        return [*self._train, *self._heldout]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(self._reward(prompt, completion))
