"""The pipeline benchmark's baseline loop (benchmarks/pipeline.py) on a few steps.

Only the in-process loop is exercised; the echo2 cases launch subprocesses and belong to
the benchmark run itself.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline.py"


@pytest.fixture(scope="module")
def pipeline():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("echo2_benchmark_pipeline", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_baseline_runs_three_steps(pipeline) -> None:  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    # One thread and a short held-out list keep this fast on a busy 2-core machine; the
    # benchmark itself uses two threads and 500 prompts.
    result = pipeline.run_baseline(3, eval_prompts=32, threads=1)
    assert torch.get_num_threads() == threads  # restored

    assert result.ok and result.error == ""
    assert result.case == "baseline"
    assert result.steps == 3
    assert result.rollouts == 3 * pipeline.GROUPS_PER_STEP * pipeline.GROUP_SIZE
    assert 0 < result.train_wall_s < result.process_wall_s
    assert result.steps_per_s == pytest.approx(3 / result.train_wall_s)
    assert result.rollouts_per_s == pytest.approx(result.rollouts / result.train_wall_s)
    for accuracy in (result.initial_accuracy, result.final_accuracy):
        assert 0.0 <= accuracy <= 1.0
    assert result.initial_accuracy > 0.1  # the shipped warm start already adds a little
    assert 0.0 < result.learner_idle_fraction < 1.0
    assert result.train_s_per_step > 0 and result.wait_s_per_step > 0
    # sampling + training account for (nearly) the whole phase
    busy = 3 * (result.train_s_per_step + result.wait_s_per_step)
    assert busy == pytest.approx(result.train_wall_s, rel=0.1)
    assert result.staleness_max == 0

    row = result.to_json()
    assert row["steps"] == 3 and row["ok"] is True
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in row.values())

    rel = pipeline.ratios([result])
    assert rel["baseline"]["steps_per_s"] == pytest.approx(1.0)
    checks = pipeline.floors([result])
    assert [c["result"] for c in checks] == ["SKIP", "SKIP"]


def test_baseline_rejects_zero_steps(pipeline) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        pipeline.run_baseline(0)


def test_packing_comparison_times_both_kinds_on_the_same_batches(pipeline) -> None:  # type: ignore[no-untyped-def]
    mixed = pipeline.packing_rows("mixed")
    assert len(mixed) == pipeline.GROUPS_PER_STEP * pipeline.GROUP_SIZE
    assert 6 <= min(mixed.sequence_lengths) and max(mixed.sequence_lengths) <= 32  # the tiny model's table
    assert len(set(mixed.sequence_lengths)) > 5  # really mixed

    result = pipeline.run_packing("mixed", repeats=1, threads=1)
    assert result["padded_fill"] < 0.8
    assert [len(result["tokens_per_s"][kind]) for kind in ("padded", "packed")] == [1, 1]
    assert result["packed_over_padded"] == pytest.approx(
        result["tokens_per_s_median"]["packed"] / result["tokens_per_s_median"]["padded"], rel=1e-2
    )
    floor = pipeline.packing_floor([result])
    assert floor["result"] == ("PASS" if result["packed_over_padded"] >= pipeline.PACKING_FLOOR else "FAIL")
    assert pipeline.packing_floor([])["result"] == "SKIP"
