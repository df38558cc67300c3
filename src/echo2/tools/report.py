"""Run report: plots and a short markdown summary of one run directory.

::

    python -m echo2.report RUN_DIR

Reads what ``python -m echo2.launch`` leaves in a run directory and writes ``RUN_DIR/report/``:

* ``reward.png`` — ``reward_mean`` per step, against step and against learner time, with a
  trailing rolling mean;
* ``accuracy.png`` — held-out pass@1, greedy, of the task's correctness predicate
  (``summary.json``'s ``pass_at_1_by_step``, or ``accuracy_by_step`` of older runs, and the
  step records' ``accuracy``) against step and learner time;
* ``staleness.png`` — staleness of the trained groups (``summary.json``'s
  ``staleness_histogram``; without it, each step's ``staleness_max``) with the budget ``S``
  (``job.staleness`` of ``topology.resolved.json``) as a vertical line;
* ``learner_idle.png`` — the learner's idle (bubble) fraction over time, a rolling
  ``sum(wait_s) / sum(wait_s + train_s)`` over a window of steps, the run's overall figure
  in the title;
* ``capacity.png`` — only for runs whose PromptSource scheduled samplers (``"kind":
  "activation"`` records): the active set over time (samplers, their measured rollouts/s
  against ``mu_min`` and the target), dollars per learner step, and the learner's bubble
  ratio per step, on one clock (unix seconds of the records);
* ``report.md`` — a table of the headline numbers and links to the plots, and, when the
  ledger records any, the samplers quarantined and the groups refused at admission, by
  sampler and reason.

Inputs are read forgivingly, since a run can be killed mid-write: the step records are those
of whichever ``metrics/*.jsonl`` holds ``"kind": "step"`` lines (the learner's), lines that do
not parse are skipped, ``summary.json`` and ``topology.resolved.json`` are optional, and a
plot without data is not written (a stale copy from an earlier report is removed).

Learner time is seconds since the learner of the first launch started, on one axis across
``--resume``: each step record's ``time_s`` counts from its own learner's start, so a
resumed learner's records (a file's ``time_s`` going back) are placed by their ``unix_s``
(or, in records without it, right after the previous segment), and every resume is drawn
as a dashed vertical line on the time axes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from echo2.rundir import RunDir, read_jsonl

STEP_KIND = "step"
RUN_TIME = "run_time_s"
"""Key ``load_run`` adds to each step record: learner time on the run's one axis (see above)."""
PLOT_NAMES = ("reward.png", "accuracy.png", "staleness.png", "learner_idle.png")
CAPACITY_PLOT = "capacity.png"
"""Written only for runs with activation records (not in PLOT_NAMES: most runs have none)."""
BROADCAST_PLOT = "broadcast.png"
"""Written only for runs whose WeightPublisher recorded T_bcast (``"kind": "broadcast"``)."""
MAX_WINDOW = 50
"""Largest rolling window, in steps."""
_DPI = 110


# -- reading -------------------------------------------------------------------------------


@dataclass
class RunData:
    """What a report is made from; every part may be empty."""

    run_dir: Path
    run_id: str
    actor: str | None = None
    """Name of the metrics file (without ``.jsonl``) the step records came from."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Step records, ordered by step."""
    skipped_lines: int = 0
    summary: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    """Problems with the inputs worth one line in report.md."""
    budget: int | None = None
    """The staleness budget S."""
    resumed_at: list[float] = field(default_factory=list)
    """Learner time (``RUN_TIME``) at which each resumed segment's first step was recorded."""

    @property
    def step_file(self) -> str | None:
        """The step records' file, relative to the run directory."""
        if self.actor is None:
            return None
        return str(RunDir(self.run_dir).metrics_path(self.actor).relative_to(self.run_dir))


def _read_json(path: Path, data: RunData) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        data.notes.append(f"`{path.name}` could not be read ({type(exc).__name__}); ignored.")
        return None
    if not isinstance(value, dict):
        data.notes.append(f"`{path.name}` is not a JSON object; ignored.")
        return None
    return value


def load_run(run_dir: Path) -> RunData:
    """Read the step records, summary and staleness budget of a run directory."""
    run = RunDir(run_dir)
    data = RunData(run_dir=run.root, run_id=run.name)
    best: tuple[int, str, list[dict[str, Any]], int] | None = None
    for path in run.metrics_paths():
        try:
            records, skipped, _ = read_jsonl(path)
        except OSError as exc:
            data.notes.append(f"`{path.relative_to(run.root)}` could not be read ({exc.strerror}).")
            continue
        steps = [r for r in records if r.get("kind") == STEP_KIND and _number(r.get("step")) is not None]
        if steps and (best is None or len(steps) > best[0]):
            best = (len(steps), path.stem, steps, skipped)
    if best is not None:
        _, data.actor, steps, data.skipped_lines = best
        data.resumed_at = place_on_run_clock(steps)
        data.steps = sorted(steps, key=lambda r: (r["step"], _number(r.get(RUN_TIME)) or 0.0))
        if data.skipped_lines:
            data.notes.append(f"{data.skipped_lines} line(s) of `{data.step_file}` did not parse and were skipped.")

    for resume in run.resume_history():
        changed = [c.get("field") for c in resume.get("changes") or [] if isinstance(c, dict)]
        if changed:
            data.notes.append(f"Resume {resume.get('resume')} ran with changes: {', '.join(map(str, changed))}.")
    data.summary = _read_json(run.summary_path, data)
    if data.summary is None:
        stopped = " (the run may have stopped before the learner wrote it)" if data.steps else ""
        data.notes.append(f"No `summary.json`{stopped}.")
    topology = _read_json(run.current_topology_path(), data)
    if topology is not None:
        if isinstance(topology.get("run_id"), str):
            data.run_id = topology["run_id"]
        job = topology.get("job")
        if isinstance(job, dict):
            data.budget = _integer(job.get("staleness"))
    if data.budget is None and data.summary is not None:
        data.budget = _integer(data.summary.get("staleness_budget"))
    return data


def place_on_run_clock(records: Sequence[dict[str, Any]]) -> list[float]:
    """Set ``RUN_TIME`` of each record (in file order); returns where each resumed segment starts.

    A segment is a run of records whose ``time_s`` does not go back (one learner process).
    Its offset on the run clock is its learner's start (``unix_s - time_s``) minus the first
    segment's, or, without ``unix_s``, the previous segment's last ``time_s``."""
    resumed_at: list[float] = []
    first_start = segment_start = None
    offset = 0.0
    previous: float | None = None
    for record in records:
        time_s = _number(record.get("time_s"))
        if time_s is None:
            continue
        unix_s = _number(record.get("unix_s"))
        start = None if unix_s is None else unix_s - time_s
        if previous is None:
            first_start = segment_start = start
        elif time_s < previous or _other_start(start, segment_start):  # another learner process
            segment_start = start
            end_of_previous = offset + previous
            by_clock = None if start is None or first_start is None else start - first_start
            offset = end_of_previous if by_clock is None else max(by_clock, end_of_previous)
            resumed_at.append(offset + time_s)
        record[RUN_TIME] = offset + time_s
        previous = time_s
    return resumed_at


_SAME_START_S = 1.0
"""Records whose learner started within this many seconds of each other are one segment
(``unix_s`` and ``time_s`` are read a moment apart and rounded; a restart takes longer)."""


def _other_start(start: float | None, segment_start: float | None) -> bool:
    return start is not None and segment_start is not None and abs(start - segment_start) > _SAME_START_S


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools, strings, NaN and infinities are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _integer(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number == int(number) else None


def time_series(data: RunData, y_key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(learner time, y)`` of the step records, in time order."""
    times, values = series(data.steps, RUN_TIME, y_key)
    order = np.argsort(times, kind="stable")
    return times[order], values[order]


def mark_resumes(ax: Any, data: RunData) -> None:
    """A dashed vertical line where each resumed segment starts on a learner-time axis."""
    for index, at in enumerate(data.resumed_at):
        ax.axvline(at, color="gray", linestyle="--", linewidth=1, label="resumed" if index == 0 else None)


def series(records: Sequence[dict[str, Any]], x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` over the records where both fields are finite numbers."""
    pairs = [(_number(r.get(x_key)), _number(r.get(y_key))) for r in records]
    kept = [(x, y) for x, y in pairs if x is not None and y is not None]
    if not kept:
        return np.empty(0), np.empty(0)
    array = np.asarray(kept, dtype=float)
    return array[:, 0], array[:, 1]


def default_window(n: int) -> int:
    """Rolling window (in steps) for ``n`` points: about a tenth of the run, 1 to MAX_WINDOW."""
    return max(1, min(MAX_WINDOW, n // 10))


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (fewer at the start)."""
    return rolling_sum(values, window) / rolling_sum(np.ones_like(values), window)


def rolling_sum(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing sum over ``window`` points (fewer at the start)."""
    cumulative = np.concatenate([[0.0], np.cumsum(values, dtype=float)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - max(1, window))
    return cumulative[ends] - cumulative[starts]


# -- plots ---------------------------------------------------------------------------------


def _save(fig: Figure, path: Path) -> Path:
    try:
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)
    return path


def plot_reward(data: RunData, path: Path, window: int | None = None) -> Path | None:
    steps, reward = series(data.steps, "step", "reward_mean")
    times, reward_t = time_series(data, "reward_mean")
    if len(reward) == 0:
        return None
    w = window or default_window(len(reward))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained", sharey=True)
    for ax, x, y, xlabel in (
        (axes[0], steps, reward, "learner step"),
        (axes[1], times, reward_t, "learner time (s)"),
    ):
        if len(y) == 0:
            ax.text(0.5, 0.5, "no timestamps", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.plot(
                x, y, color="tab:blue", alpha=0.35, linewidth=1, marker="." if len(y) < 30 else None, label="per step"
            )
            ax.plot(x, rolling_mean(y, w), color="tab:blue", linewidth=2, label=f"rolling mean ({w} steps)")
            ax.legend(loc="best", fontsize="small")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    mark_resumes(axes[1], data)
    axes[0].set_ylabel("reward_mean")
    fig.suptitle(f"Training reward — {data.run_id}")
    return _save(fig, path)


def accuracy_points(data: RunData) -> list[tuple[int, float]]:
    """(step, pass@1): the summary's ``pass_at_1_by_step`` (older runs: ``accuracy_by_step``)
    completed by the step records' ``accuracy``."""
    points: dict[int, float] = {}
    for record in data.steps:
        step, acc = _integer(record.get("step")), _number(record.get("accuracy"))
        if step is not None and acc is not None:
            points[step] = acc
    summary = data.summary or {}
    by_step = summary.get("pass_at_1_by_step", summary.get("accuracy_by_step"))
    if isinstance(by_step, list):
        for item in by_step:
            if isinstance(item, list | tuple) and len(item) == 2:
                step, acc = _integer(item[0]), _number(item[1])
                if step is not None and acc is not None:
                    points[step] = acc
    return sorted(points.items())


def step_times(data: RunData, steps: np.ndarray) -> np.ndarray | None:
    """Learner time of each step, interpolated from the step records (None without any).

    Step 0 (the warm-start evaluation) is placed where step 1 started: its ``time_s`` minus
    its ``wait_s`` and ``train_s``."""
    known: dict[float, float] = {}
    for record in data.steps:
        step, time_s = _number(record.get("step")), _number(record.get(RUN_TIME))
        if step is not None and time_s is not None:
            known[step] = time_s  # a step trained again after a resume: where it counted
    if not known:
        return None
    if 0.0 not in known:
        first = min(known)
        first_record = next(r for r in data.steps if _number(r.get("step")) == first)
        spent = sum(_number(first_record.get(k)) or 0.0 for k in ("wait_s", "train_s"))
        known[0.0] = max(0.0, known[first] - spent)
    xs = np.asarray(sorted(known))
    return np.interp(steps, xs, np.asarray([known[x] for x in xs]))


def plot_accuracy(data: RunData, path: Path) -> Path | None:
    points = accuracy_points(data)
    if not points:
        return None
    steps = np.asarray([p[0] for p in points], dtype=float)
    acc = np.asarray([p[1] for p in points], dtype=float)
    times = step_times(data, steps)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained", sharey=True)
    axes[0].plot(steps, acc, marker="o", color="tab:green")
    axes[0].set_xlabel("learner step")
    if times is None:
        axes[1].text(0.5, 0.5, "no step timestamps", ha="center", va="center", transform=axes[1].transAxes)
    else:
        axes[1].plot(times, acc, marker="o", color="tab:green")
        mark_resumes(axes[1], data)
    axes[1].set_xlabel("learner time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    top = max(1.0, float(acc.max()))
    axes[0].set_ylim(-0.02, top + 0.02)
    axes[0].set_ylabel("held-out pass@1 (greedy)")
    fig.suptitle(
        f"Held-out pass@1, greedy — step {points[0][0]}: {points[0][1]:.3f} → step {points[-1][0]}: {points[-1][1]:.3f}"
    )
    return _save(fig, path)


def staleness_counts(data: RunData) -> tuple[dict[int, int], str] | None:
    """Staleness → count and what is counted: the summary's histogram, else the steps' max."""
    histogram = (data.summary or {}).get("staleness_histogram")
    counts: dict[int, int] = {}
    if isinstance(histogram, dict):
        for key, value in histogram.items():
            try:
                staleness = int(key)
            except (TypeError, ValueError):
                continue
            n = _integer(value)
            if n is not None and n > 0:
                counts[staleness] = counts.get(staleness, 0) + n
        if counts:
            return counts, "trained groups"
    for record in data.steps:
        step_max = _integer(record.get("staleness_max"))
        if step_max is not None:
            counts[step_max] = counts.get(step_max, 0) + 1
    if counts:
        return counts, "steps (by the step's largest staleness)"
    return None


def plot_staleness(data: RunData, path: Path) -> Path | None:
    found = staleness_counts(data)
    if found is None:
        return None
    counts, what = found
    keys = sorted(counts)
    budget = data.budget
    colors = ["tab:red" if budget is not None and k > budget else "tab:blue" for k in keys]
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    ax.bar(keys, [counts[k] for k in keys], width=0.8, color=colors)
    hi = max(keys[-1], budget if budget is not None else keys[-1])
    lo = min(keys[0], 0)
    if budget is not None:
        ax.axvline(budget + 0.5, color="tab:red", linestyle="--", linewidth=1.5, label=f"budget S = {budget}")
        ax.legend(loc="upper left", fontsize="small")
    ax.set_xlim(lo - 0.7, hi + 1.2)
    if hi - lo <= 30:
        ax.set_xticks(range(lo, hi + 1))
    ax.set_xlabel("staleness (learner version − sampler version)")
    ax.set_ylabel(what)
    ax.grid(axis="y", alpha=0.3)
    total = sum(counts.values())
    over = sum(n for k, n in counts.items() if budget is not None and k > budget)
    noun = "trained groups" if what == "trained groups" else "steps (per-step max)"
    title = f"Staleness — {total} {noun}, max {keys[-1]}"
    if budget is not None:
        title += f", {over} over S"
    ax.set_title(title)
    return _save(fig, path)


def overall_idle_fraction(data: RunData) -> float | None:
    """The summary's ``learner_idle_fraction``, else sum(wait) / sum(wait + train) of the steps."""
    value = _number((data.summary or {}).get("learner_idle_fraction"))
    if value is not None:
        return value
    pairs = [(w, t) for w, t in (_wait_train(r) for r in data.steps) if w is not None and t is not None]
    wait = np.asarray([w for w, _ in pairs], dtype=float)
    train = np.asarray([t for _, t in pairs], dtype=float)
    busy = float(wait.sum() + train.sum())
    return float(wait.sum()) / busy if busy > 0 else None


def _wait_train(record: dict[str, Any]) -> tuple[float | None, float | None]:
    wait, train = _number(record.get("wait_s")), _number(record.get("train_s"))
    return (wait, train) if wait is not None and train is not None else (None, None)


def plot_learner_idle(data: RunData, path: Path, window: int | None = None) -> Path | None:
    rows = []
    for record in data.steps:
        time_s = _number(record.get(RUN_TIME))
        wait_s, train_s = _wait_train(record)
        if time_s is not None and wait_s is not None and train_s is not None:
            rows.append((time_s, wait_s, train_s))
    if not rows:
        return None
    rows.sort(key=lambda row: row[0])
    array = np.asarray(rows, dtype=float)
    times, wait, train = array[:, 0], array[:, 1], array[:, 2]
    w = window or default_window(len(rows))
    busy = rolling_sum(wait + train, w)
    rolling = np.divide(rolling_sum(wait, w), busy, out=np.zeros_like(busy), where=busy > 0)
    per_step = np.divide(wait, wait + train, out=np.zeros_like(wait), where=(wait + train) > 0)
    overall = overall_idle_fraction(data)
    fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
    ax.plot(times, per_step, color="tab:orange", alpha=0.3, linewidth=1, label="per step")
    ax.plot(times, rolling, color="tab:orange", linewidth=2, label=f"rolling ({w} steps)")
    if overall is not None:
        ax.axhline(overall, color="gray", linestyle=":", linewidth=1, label="overall")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(0, max(0.05, min(1.0, float(max(per_step.max(), rolling.max())) * 1.1)))
    mark_resumes(ax, data)
    ax.set_xlabel("learner time (s)")
    ax.set_ylabel("idle: wait / (wait + train)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize="small")
    overall_text = f"{overall:.1%}" if overall is not None else "n/a"
    ax.set_title(f"Learner idle (bubble) fraction — overall {overall_text}")
    return _save(fig, path)


def activation_records(run_dir: Path) -> list[dict[str, Any]]:
    """The PromptSource's ``activation`` records (with ``unix_s``), oldest first."""
    records = RunDir(run_dir).all_metrics("activation")
    return sorted((r for r in records if _number(r.get("unix_s")) is not None), key=lambda r: r["unix_s"])


def dollars_per_step_series(records: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(unix_s, dollars per step between consecutive records that saw steps)."""
    xs, ys = [], []
    for a, b in itertools.pairwise(records):
        da, db = _number(a.get("dollars_total")), _number(b.get("dollars_total"))
        sa, sb = _number(a.get("steps")), _number(b.get("steps"))
        if da is None or db is None or sa is None or sb is None or sb <= sa:
            continue
        xs.append(b["unix_s"])
        ys.append((db - da) / (sb - sa))
    return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def capacity_notes(records: Sequence[dict[str, Any]]) -> list[str]:
    """Headline lines of the activation records: policy, final active set, dollars per step."""
    if not records:
        return []
    last = records[-1]
    notes = [f"policy `{last.get('policy')}`: {last.get('n_active')} of {last.get('n_available')} samplers active"]
    if _number(last.get("steps")) and _number(last.get("dollars_total")) is not None:
        notes.append(f"dollars per step (whole run): {last['dollars_total'] / last['steps']:.6g}")
    if (mu := _number(last.get("mu_min"))) is not None:
        notes.append(f"mu_min {mu:.4g} rollouts/s, active {last.get('active_mu')} rollouts/s")
    notes.append(f"last decision: {last.get('reason', '')}")
    return notes


def plot_capacity(data: RunData, records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    if not records:
        return None
    t0 = float(records[0]["unix_s"])
    times = np.asarray([r["unix_s"] - t0 for r in records], dtype=float)
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), layout="constrained", sharex=True)
    ax = axes[0]
    ax.step(times, [r.get("n_active", 0) for r in records], where="post", color="tab:blue", label="active samplers")
    ax.set_ylabel("active samplers")
    ax.set_ylim(0, max(int(r.get("n_available") or r.get("n_active") or 0) for r in records) + 1)
    ax2 = ax.twinx()
    for key, style, label in (
        ("active_mu", "-", "active mu"),
        ("target_mu", "--", "target"),
        ("mu_min", ":", "mu_min"),
    ):
        ys = [_number(r.get(key)) for r in records]
        ys_arr = np.asarray([np.nan if y is None else y for y in ys], dtype=float)
        ax2.plot(times, ys_arr, linestyle=style, color="tab:green", label=label)
    ax2.set_ylabel("rollouts/s")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="lower right", fontsize="small")
    ax.grid(alpha=0.3)
    policy = records[-1].get("policy", "?")
    ax.set_title(f"Active set ({policy}) — {data.run_id}")
    x, y = dollars_per_step_series(records)
    if len(y):
        axes[1].plot(x - t0, y, color="tab:red", marker=".")
    else:
        axes[1].text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=axes[1].transAxes)
    axes[1].set_ylabel("dollars per step")
    axes[1].grid(alpha=0.3)
    rows = [
        (float(r["unix_s"]) - t0, w / (w + t))
        for r in data.steps
        for w, t in [_wait_train(r)]
        if _number(r.get("unix_s")) is not None and w is not None and t is not None and w + t > 0
    ]
    if rows:
        arr = np.asarray(rows, dtype=float)
        axes[2].plot(arr[:, 0], arr[:, 1], color="tab:orange", marker=".", linewidth=1)
        axes[2].yaxis.set_major_formatter(PercentFormatter(1.0))
    else:
        axes[2].text(0.5, 0.5, "no step records with unix_s", ha="center", va="center", transform=axes[2].transAxes)
    axes[2].set_ylabel("learner bubble ratio")
    axes[2].set_xlabel("seconds since the first activation record")
    axes[2].grid(alpha=0.3)
    return _save(fig, path)


def broadcast_records(run_dir: Path) -> list[dict[str, Any]]:
    """The WeightPublisher's ``broadcast`` records (T_bcast per version), by version."""
    out = [
        r
        for r in RunDir(run_dir).all_metrics("broadcast")
        if _number(r.get("t_bcast_s")) is not None and _number(r.get("version")) is not None
    ]
    return sorted(out, key=lambda r: (_number(r.get("incarnation")) or 0, r["version"]))


def broadcast_notes(run_dir: Path) -> list[str]:
    """Every version's fate (its ``broadcast`` record: T_bcast, or none, and how many of the
    active members installed it) and, when broadcast was slower than training, the
    publisher's last word on what would restore overlap (its ``publication`` records)."""
    run = RunDir(run_dir)
    records = [r for r in run.all_metrics("broadcast") if _number(r.get("version")) is not None]
    if not records:
        return []
    reached = [float(r["t_bcast_s"]) for r in records if _number(r.get("t_bcast_s")) is not None]
    notes = [f"{len(records)} versions broadcast; {len(reached)} reached T_bcast"]
    if reached:
        notes[0] += f" (median {np.median(reached):.3g} s, max {max(reached):.3g} s)"
    short = [r for r in records if _number(r.get("t_bcast_s")) is None]
    if short:
        installed = [_number(r.get("installed")) or 0.0 for r in short]
        active = [_number(r.get("active")) or 0.0 for r in short]
        notes.append(
            f"{len(short)} never did (superseded, or members too slow): installed by a median of "
            f"{np.median(installed):.3g} of {np.median(active):.3g} active members"
        )
    publication = run.all_metrics("publication")
    if publication:
        last = publication[-1]
        bound = ">" if last.get("t_bcast_lower_bound") else ""
        notes.append(
            f"Broadcast was the bottleneck ({len(publication)} times said): T_bcast {bound}{last.get('t_bcast_s')} s "
            f"> kappa x T_train = {last.get('kappa')} x {last.get('t_train_s')} s; overlap needs kappa >= "
            f"{last.get('kappa_needed')} (S >= {last.get('staleness_needed')}) or at most "
            f"{(_number(last.get('bytes_per_version_needed')) or 0) / 1e6:.3g} MB per version "
            f"(was {(_number(last.get('bytes_per_version')) or 0) / 1e6:.3g} MB); {last.get('held')} snapshots waited "
            f"for the version in flight, {last.get('skipped')} were skipped"
        )
    return notes


def plot_broadcast(data: RunData, records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """T_bcast (publication until 1/gamma of active samplers installed) per version."""
    if not records:
        return None
    versions = np.asarray([r["version"] for r in records], dtype=float)
    t_bcast = np.asarray([r["t_bcast_s"] for r in records], dtype=float)
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    ax.plot(versions, t_bcast, marker=".", linewidth=1, color="tab:purple")
    ax.set_xlabel("policy version")
    ax.set_ylabel("T_bcast (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    mode = records[-1].get("mode", "?")
    ax.set_title(f"Weight broadcast ({mode}): median T_bcast {np.median(t_bcast):.3g} s, max {t_bcast.max():.3g} s")
    return _save(fig, path)


# -- report.md ------------------------------------------------------------------------------


def _format(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_format(v)}" for k, v in value.items()) or "none"
    return str(value)


def headline_rows(data: RunData) -> list[tuple[str, str]]:
    """(name, value) rows: from summary.json, or what the step records show without it."""
    summary = data.summary
    if summary is not None:
        rows: list[tuple[str, str]] = []
        for key in ("steps", "wall_s"):
            if key in summary:
                rows.append((key, _format(summary[key])))
        if "initial_pass_at_1" in summary:
            measured = (
                f" ({summary.get('eval_decoding', 'greedy')}, {summary.get('eval_prompts', '?')} held-out prompts)"
            )
            for key in ("initial_pass_at_1", "final_pass_at_1"):
                value = summary.get(key)
                shown = (
                    "n/a (the task declares no correctness predicate)" if value is None else _format(value) + measured
                )
                rows.append((key, shown))
            if "initial_pass_at_k" in summary:  # sampled, when the learner was asked to
                sampled = f" ({summary.get('eval_pass_at_k_metric', 'pass@k')}: {summary.get('eval_pass_at_k_decoding', '?')})"
                for key in ("initial_pass_at_k", "final_pass_at_k"):
                    value = summary.get(key)
                    rows.append((key, "n/a" if value is None else _format(value) + sampled))
            for key in ("initial_eval_mean_reward", "final_eval_mean_reward"):
                rows.append((key, _format(summary.get(key))))
        else:  # a run from before pass@1 was named
            for key in ("initial_accuracy", "final_accuracy"):
                if key in summary:
                    rows.append((key, _format(summary[key])))
        if "staleness_max" in summary:
            suffix = f" (budget S = {data.budget})" if data.budget is not None else ""
            rows.append(("staleness_max", _format(summary["staleness_max"]) + suffix))
        for key in ("rollouts_trained", "rollouts_trained_twice", "drops_by_reason"):
            if key in summary:
                rows.append((key, _format(summary[key])))
        if (idle := _number(summary.get("learner_idle_fraction"))) is not None:
            rows.append(("learner_idle_fraction", f"{idle:.2%}"))
        for key in ("steps_per_s", "rollouts_per_s"):
            if key in summary:
                rows.append((key, _format(summary[key])))
        return rows
    if not data.steps:
        return []
    rows = [("steps (from metrics)", _format(data.steps[-1].get("step")))]
    _, times = series(data.steps, "step", RUN_TIME)
    if len(times):
        rows.append(("last step at learner time (s)", _format(float(times.max()))))
    points = accuracy_points(data)
    if points:
        rows.append(("last accuracy (from metrics)", f"step {points[-1][0]}: {points[-1][1]:.4g}"))
    _, staleness = series(data.steps, "step", "staleness_max")
    if len(staleness):
        suffix = f" (budget S = {data.budget})" if data.budget is not None else ""
        rows.append(("staleness_max (from metrics)", f"{int(staleness.max())}{suffix}"))
    _, rollouts = series(data.steps, "step", "rollouts")
    if len(rollouts):
        rows.append(("rollouts_trained (from metrics)", _format(int(rollouts.sum()))))
    if (idle := overall_idle_fraction(data)) is not None:
        rows.append(("learner_idle_fraction (from metrics)", f"{idle:.2%}"))
    return rows


_SECTIONS = {
    "reward.png": "Reward",
    "accuracy.png": "Held-out accuracy",
    "staleness.png": "Staleness",
    "learner_idle.png": "Learner idle fraction",
}


def admission_notes(run_dir: Path) -> list[str]:
    """One line per quarantined sampler, then one per sampler with groups refused at
    admission (the ledger's ``quarantined`` and ``rejected`` events)."""
    from collections import Counter

    from echo2 import ledger

    quarantined: dict[str, str] = {}
    refused: dict[str, Counter[str]] = {}
    for event in ledger.read([run_dir]).events:
        if isinstance(event, ledger.Quarantined):
            quarantined.setdefault(event.sampler, event.reason)
        elif isinstance(event, ledger.Rejected) and event.outcome == "rejected":
            refused.setdefault(event.sampler or "?", Counter())[event.reason] += 1
    lines = [f"quarantined `{sampler}`: {why}" for sampler, why in sorted(quarantined.items())]
    for sampler, reasons in sorted(refused.items()):
        detail = ", ".join(f"{reason} {n}" for reason, n in reasons.most_common())
        lines.append(f"refused from `{sampler}`: {sum(reasons.values())} groups ({detail})")
    return lines


def render_markdown(
    data: RunData,
    written: Sequence[Path],
    capacity_notes: Sequence[str] = (),
    admission: Sequence[str] = (),
    broadcast: Sequence[str] = (),
) -> str:
    lines = [f"# Run report: {data.run_id}", "", f"Run directory: `{data.run_dir}`", ""]
    if data.actor is not None:
        lines += [f"Step records: `{data.step_file}` ({len(data.steps)} steps).", ""]
    else:
        lines += ["No step records found under `metrics/`.", ""]
    rows = headline_rows(data)
    if rows:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {name} | {value.replace('|', '/')} |" for name, value in rows]
        lines.append("")
    if data.notes:
        lines += [f"- {note}" for note in data.notes]
        lines.append("")
    names = {path.name for path in written}
    for name in PLOT_NAMES:
        lines.append(f"## {_SECTIONS[name]}")
        lines.append("")
        lines.append(f"![{_SECTIONS[name]}]({name})" if name in names else "_No data for this plot._")
        lines.append("")
    if CAPACITY_PLOT in names:
        lines += ["## Capacity: active set, dollars per step, bubble ratio", ""]
        lines += [f"- {note}" for note in capacity_notes]
        lines += ["", f"![Capacity]({CAPACITY_PLOT})", ""]
    if BROADCAST_PLOT in names or broadcast:
        lines += ["## Weight broadcast: T_bcast per version", ""]
        lines += [f"- {note}" for note in broadcast]
        lines += ["", f"![T_bcast]({BROADCAST_PLOT})", ""] if BROADCAST_PLOT in names else [""]
    if admission:
        lines += ["## Untrusted samplers: quarantine and admission", ""]
        lines += [f"- {note}" for note in admission]
        lines.append("")
    return "\n".join(lines)


# -- entry points ---------------------------------------------------------------------------


def write_report(run_dir: Path, *, window: int | None = None) -> list[Path]:
    """Write the plots and ``report.md`` into ``run_dir/report/``; returns the paths written.

    ``window`` is the rolling window in steps (default: about a tenth of the run)."""
    run = RunDir(run_dir)
    data = load_run(run.root)
    out = run.report_dir
    out.mkdir(exist_ok=True)
    plotters = {
        "reward.png": lambda p: plot_reward(data, p, window),
        "accuracy.png": lambda p: plot_accuracy(data, p),
        "staleness.png": lambda p: plot_staleness(data, p),
        "learner_idle.png": lambda p: plot_learner_idle(data, p, window),
    }
    written: list[Path] = []
    for name in PLOT_NAMES:
        path = out / name
        if plotters[name](path) is not None:
            written.append(path)
        else:
            path.unlink(missing_ok=True)  # never leave a plot of an earlier report behind
    capacity = out / CAPACITY_PLOT
    activations = activation_records(run.root)
    if plot_capacity(data, activations, capacity) is not None:
        written.append(capacity)
    else:
        capacity.unlink(missing_ok=True)
    broadcast = out / BROADCAST_PLOT
    if plot_broadcast(data, broadcast_records(run.root), broadcast) is not None:
        written.append(broadcast)
    else:
        broadcast.unlink(missing_ok=True)
    markdown = out / "report.md"
    notes = admission_notes(run.root)
    markdown.write_text(
        render_markdown(data, written, capacity_notes(activations), notes, broadcast_notes(run.root)), encoding="utf-8"
    )
    written.append(markdown)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m echo2.report", description="Write plots and report.md for an echo2 run directory."
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory made by echo2.launch")
    parser.add_argument("--window", type=int, default=None, help="rolling window in steps (default: auto)")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"{parser.prog}: {args.run_dir}: no such run directory", file=sys.stderr)
        return 2
    for path in write_report(args.run_dir, window=args.window):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
