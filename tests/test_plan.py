"""``python -m echo2.plan``: the capacity plan of a topology."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2.rundir import RunDir
from echo2.tools.plan import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "capacity.toml"

MIXED = """
[job]
staleness = 3
group_size = 4
groups_per_step = 16
max_new_tokens = 5

[actors.prompt_source]
kind = "prompt_source"
config = { learner_price_per_hour = 1.5 }
[actors.rewarder]
kind = "rewarder"
[actors.buffer]
kind = "buffer"
[actors.learner]
kind = "learner"
config = { simulated_train_s = 1.0 }
[actors.weight_publisher]
kind = "weight_publisher"
[actors.fast]
kind = "sampler"
replicas = 8
process = "s"
config = { engine = "simulated", engine_kwargs = { seconds_per_token = 0.125, success_rate = 0.5 }, credits = 1, max_batch_groups = 1, price_per_hour = 0.69 }
[actors.cheap]
kind = "sampler"
replicas = 8
process = "s"
config = { engine = "simulated", engine_kwargs = { seconds_per_token = 0.2, success_rate = 0.5 }, credits = 1, max_batch_groups = 1, price_per_hour = 0.34 }
[actors.slow]
kind = "sampler"
replicas = 8
process = "s"
config = { engine = "simulated", engine_kwargs = { seconds_per_token = 0.4, success_rate = 0.5 }, credits = 1, max_batch_groups = 1, price_per_hour = 0.60 }
[actors.real]
kind = "sampler"
process = "s"
config = { engine = "torch", price_per_hour = 0.1 }
"""


def _plan(capsys, *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_mixed_pool_plan_picks_cheapest_rho_and_reports_the_model(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.toml"
    path.write_text(MIXED)
    plan = _plan(capsys, str(path))
    assert plan["R"] == 64 and plan["kappa"] == 2 and plan["t_train_s"] == 1.0
    assert plan["mu_min"] == pytest.approx(64.0)  # 2 * 64 / (2 * 1 - 0)
    assert plan["target_mu"] == pytest.approx(70.4)
    active = set(plan["active"])
    assert {f"cheap-{i}" for i in range(8)} <= active
    assert not any(a.startswith("slow") for a in active)
    assert plan["active_mu"] >= plan["target_mu"] and plan["feasible"]
    assert plan["predicted_bubble_ratio"] == 0.0
    assert plan["staleness_bound"] == 2 + 1 - 1  # kappa + ceil((0 + 64/mu) / 1) - 1, mu >= 64
    assert plan["unknown_mu"] == ["real"]  # a torch sampler without a measurement is left out
    assert plan["cost_per_step"] == pytest.approx((plan["active_cost_per_hour"] + 1.5) / 3600)


def test_declared_overrides_and_the_human_output(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.toml"
    path.write_text(MIXED)
    plan = _plan(capsys, str(path), "--t-bcast-s", "0.5", "--mu", "real=100", "--set", "job.staleness=1")
    assert plan["kappa"] == 1 and plan["mu_min"] == pytest.approx(128.0)  # 64 / (1 - 0.5)
    assert plan["active"][0] == "real"  # rho 0.001: cheapest by far
    assert plan["unknown_mu"] == []
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "mu_min = 64 rollouts/s" in text and "cost per step = $" in text


def test_unreachable_and_bad_inputs(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.toml"
    path.write_text(MIXED)
    plan = _plan(capsys, str(path), "--t-bcast-s", "3")
    assert plan["feasible"] is False and "no finite capacity" in plan["reason"]
    assert main([str(path), "--mu", "real"]) == 2
    assert "--mu" in capsys.readouterr().err
    assert main([str(path), "--set", "actors.learner.config.simulated_train_s=0"]) == 2
    assert "T_train unknown" in capsys.readouterr().err


def test_example_topology_plans(capsys) -> None:
    plan = _plan(capsys, str(EXAMPLE))
    assert plan["pool_size"] >= 16 and plan["mu_min"] > 0


def test_measured_figures_from_a_run_directory(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.toml"
    path.write_text(MIXED)
    run = RunDir(tmp_path / "run")
    run.metrics_dir.mkdir(parents=True)
    run.metrics_path("learner").write_text(
        "\n".join(json.dumps({"kind": "step", "step": i, "wait_s": 0.0, "train_s": 2.0}) for i in range(5))
        + "\nnot json\n"
    )
    run.metrics_path("prompt_source").write_text(
        json.dumps({"kind": "activation", "t_bcast_s": 1.0, "mu_by_sampler": {"real": 50.0, "cheap-0": 8.0}}) + "\n"
    )
    plan = _plan(capsys, str(path), "--run", str(run.root))
    assert plan["t_train_s"] == 2.0 and plan["t_bcast_s"] == 1.0
    assert plan["mu_min"] == pytest.approx(2 * 64 / (4.0 - 1.0))
    assert plan["sources"]["mu"].startswith("measured")
    assert plan["rho"]["real"] == pytest.approx(0.1 / 50)


def test_measured_bytes_per_version_predict_t_bcast_and_show_what_dense_would_need(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.toml"
    path.write_text(MIXED)
    run = RunDir(tmp_path / "run")
    run.metrics_dir.mkdir(parents=True)
    # Delta versions of a 100 MB state, 2-3 MB on the wire each, and one dense anchor.
    wire = [2_000_000, 3_000_000, 100_000_000, 2_500_000, 2_500_000]
    run.metrics_path("weight_publisher").write_text(
        "\n".join(json.dumps({"kind": "broadcast", "bytes": 100_000_000, "wire_bytes": w}) for w in wire) + "\n"
    )
    plan = _plan(capsys, str(path), "--run", str(run.root), "--link-mbps", "100")
    assert plan["bytes_per_version"] == 2_500_000 and plan["dense_bytes_per_version"] == 100_000_000
    assert plan["t_bcast_s"] == pytest.approx(2_500_000 * 8 / 100e6)  # 0.2 s: bytes / Bw
    assert plan["t_bcast_dense_s"] == pytest.approx(8.0)
    assert plan["mu_min"] == pytest.approx(2 * 64 / (2 * 1.0 - 0.2))
    assert plan["mu_min_dense"] is None  # 8 s of broadcast per 1 s step: no pool is enough
    assert main([str(path), "--link-mbps", "100"]) == 2  # no bytes known
    assert "--link-mbps" in capsys.readouterr().err
