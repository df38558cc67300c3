"""The dataset task: reading, mapping, the split, the epoch stream, resume, and the launcher's checks."""

from __future__ import annotations

import csv
import itertools
import json
import logging
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from echo2.actors.prompt_source import PromptSource
from echo2.job import JobConfig
from echo2.launch import main
from echo2.tasks.base import Prompt, correctness, load_task, prompt_stream, with_reward
from echo2.tasks.dataset import DatasetError, DatasetTask, read_rows
from echo2.tasks.evaluation import score_heldout

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "data" / "addition500.jsonl"
EXAMPLE = ROOT / "examples" / "dataset.toml"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sums(n: int) -> list[dict[str, Any]]:
    return [{"q": f"{100 + i}+{200 + i}=", "a": str(300 + 2 * i)[::-1], "level": i % 3} for i in range(n)]


def task_of(path: Path, **kwargs: Any) -> DatasetTask:
    return DatasetTask(str(path), prompt_field="q", answer_field="a", **kwargs)


# -- reading and mapping ------------------------------------------------------------------


def test_jsonl_csv_and_json_list_read_the_same_rows(tmp_path: Path) -> None:
    rows = [{"q": "1+2=", "a": "3", "level": "1"}, {"q": "2+2=", "a": "4", "level": "2"}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    with (tmp_path / "d.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["q", "a", "level"])
        writer.writeheader()
        writer.writerows(rows)
    for name in ("d.jsonl", "d.json", "d.csv"):
        assert read_rows(tmp_path / name) == rows, name


def test_parquet_reads_through_pyarrow(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed here")
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed here")
    rows = sums(20)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_rows(tmp_path / "d.parquet") == rows


def test_a_saved_hf_dataset_reads_through_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the 'datasets' library is not installed here")
    rows = sums(20)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    assert read_rows(tmp_path / "saved", split="train") == rows
    with pytest.raises(DatasetError, match=r"no split 'test' \(splits: train\)"):
        read_rows(tmp_path / "saved", split="test")


def test_parquet_without_pyarrow_or_datasets_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    (tmp_path / "saved").mkdir()
    for module in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(
        DatasetError, match=r"d.parquet: reading Parquet needs pyarrow or datasets: pip install datasets$"
    ):
        read_rows(tmp_path / "d.parquet")
    with pytest.raises(
        DatasetError, match=r"saved: a saved Hugging Face dataset needs datasets: pip install datasets$"
    ):
        read_rows(tmp_path / "saved")


def test_fields_map_to_prompt_and_the_rest_reaches_the_reward_as_meta(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+2=", "a": 3, "level": 1, "source": "x"}] * 1 + sums(30))
    task = task_of(path, heldout_fraction=0.3)
    first = next(p for p in task.every_prompt() if p.text == "1+2=")
    assert (first.answer, first.meta) == ("3", {"level": 1, "source": "x"})  # a number answer as JSON text
    only_level = task_of(path, heldout_fraction=0.3, meta_fields=["level"])
    assert all(set(p.meta) == {"level"} for p in only_level.every_prompt())

    seen: list[dict[str, Any]] = []
    module = tmp_path / "meta_reward_mod.py"
    module.write_text("SEEN = []\ndef reward(prompt, completion):\n    SEEN.append(prompt.meta)\n    return 0.5\n")
    sys.path.insert(0, str(tmp_path))
    try:
        custom = task_of(path, heldout_fraction=0.3, reward="meta_reward_mod:reward")
        prompt = next(custom.prompts(0))
        assert custom.reward(prompt, "x") == 0.5
        import meta_reward_mod  # type: ignore[import-not-found]

        seen = meta_reward_mod.SEEN
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("meta_reward_mod", None)
    assert seen == [prompt.meta] and "level" in prompt.meta
    assert correctness(custom) is None  # a custom reward is no verdict unless `correct` names one


def test_reward_and_correctness_predicate(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": f"What is {i}+1?", "a": str(i + 1)} for i in range(40)])
    exact = task_of(path, heldout_fraction=0.3)
    math = task_of(path, heldout_fraction=0.3, reward="math_answer")
    p = exact.heldout(1)[0]
    assert exact.reward(p, f" {p.answer} ") == 1.0 and exact.reward(p, f"it is {p.answer}") == 0.0
    assert math.reward(p, f"The answer is \\boxed{{{p.answer}}}") == 1.0
    for task in (exact, math):  # binary built-in rewards are their own predicate
        correct = correctness(task)
        assert correct is not None and correct(p, p.answer) and not correct(p, "nope")
    # A training reward swapped by the job keeps the task's metric.
    shaped = with_reward(exact, lambda prompt, completion: 0.25)
    assert correctness(shaped) is not None and correctness(shaped)(p, p.answer)  # type: ignore[misc]
    score = score_heldout(shaped, 7, [p, p], [p.answer, "wrong"])
    assert (score.step, score.pass_at_1, score.mean_reward, score.prompts) == (7, 0.5, 0.25, 2)
    no_predicate = task_of(path, heldout_fraction=0.3, reward="echo2.tasks.base:exact_match")
    assert score_heldout(no_predicate, 0, [p], [p.answer]).pass_at_1 is None


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([{"q": "1+1=", "b": "2"}], {}, r"d.jsonl: row 0 has no field 'a' \(fields: q, b\)$"),
        ([{"q": 5, "a": "5"}], {}, r"d.jsonl: row 0: field 'q' is a int, not text$"),
        ([{"q": "1=", "a": "1", "id": "x"}, {"q": "2=", "a": "2", "id": "x"}], {"id_field": "id"}, r"id 'x'"),
        ([], {}, r"d.jsonl: holds no rows$"),
        (sums(3), {"heldout_fraction": 0.01}, r"the held-out split is empty \(heldout_fraction = 0.01 of 3 rows"),
    ],
)
def test_bad_rows_are_one_line_errors_naming_the_file(
    tmp_path: Path, rows: list[dict[str, Any]], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(DatasetError, match=message):
        task_of(write_jsonl(tmp_path / "d.jsonl", rows), **kwargs)


# -- the split -----------------------------------------------------------------------------


def test_hash_split_is_disjoint_stable_and_keeps_duplicates_together(tmp_path: Path) -> None:
    rows = sums(200) + sums(50)  # 50 prompts twice
    task = task_of(write_jsonl(tmp_path / "d.jsonl", rows), heldout_fraction=0.2)
    train = {p.text for p in itertools.islice(task.prompts(0), task.train_size * 3)}
    held = {p.text for p in task.heldout(1000)}
    assert train and held and not train & held
    assert train | held == {r["q"] for r in rows}
    assert 20 <= len(held) <= 60  # about a fifth of 200 distinct prompts
    again = task_of(tmp_path / "d.jsonl", heldout_fraction=0.2)
    assert [p.task_id for p in again.heldout(1000)] == [p.task_id for p in task.heldout(1000)]
    assert task.heldout(5) == task.heldout(1000)[:5]


def test_heldout_file_split_refuses_prompts_also_in_training(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", sums(20))
    held = write_jsonl(tmp_path / "held.jsonl", [{"q": "9+9=", "a": "81"}])
    task = task_of(train, heldout_path=str(held))
    assert [p.text for p in task.heldout(10)] == ["9+9="] and task.train_size == 20
    write_jsonl(held, [{"q": "9+9=", "a": "81"}, sums(20)[4]])
    with pytest.raises(DatasetError, match=r"held.jsonl: 1 held-out prompts also appear in .*train.jsonl"):
        task_of(train, heldout_path=str(held))


# -- the stream ----------------------------------------------------------------------------


def test_each_epoch_is_a_seeded_shuffle_of_every_training_row_with_unique_stable_ids(tmp_path: Path) -> None:
    task = task_of(write_jsonl(tmp_path / "d.jsonl", sums(60)), heldout_fraction=0.2, epochs=3)
    n = task.train_size
    stream = list(task.prompts(seed=1))
    assert len(stream) == 3 * n  # epochs counted: the stream ends
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    rows = sorted(p.text for p in task.every_prompt() if p not in task.heldout(1000))
    for e, epoch in enumerate(epochs):
        assert sorted(p.text for p in epoch) == rows  # every row once per epoch
        assert all(p.task_id.endswith(f"@e{e}") for p in epoch)
    assert [p.text for p in epochs[0]] != [p.text for p in epochs[1]]  # reshuffled per epoch
    ids = [p.task_id for p in stream]
    assert len(set(ids)) == len(ids)  # unique across epochs: the Buffer never sees a repeat
    rerun = task_of(tmp_path / "d.jsonl", heldout_fraction=0.2, epochs=3)
    assert [p.task_id for p in rerun.prompts(seed=1)] == ids  # stable across runs
    assert [p.task_id for p in rerun.prompts(seed=2)] != ids  # the seed orders the epochs
    in_order = task_of(tmp_path / "d.jsonl", heldout_fraction=0.2, shuffle=False)
    assert [p.text for p in itertools.islice(in_order.prompts(0), n)] == [p.text for p in in_order.every_prompt()[:n]]


def test_start_positions_the_stream_without_replaying_it(tmp_path: Path) -> None:
    task = task_of(write_jsonl(tmp_path / "d.jsonl", sums(40)), heldout_fraction=0.2)
    whole = list(itertools.islice(task.prompts(3), 200))
    for start in (0, 1, task.train_size - 1, task.train_size, 2 * task.train_size + 5):
        assert list(itertools.islice(prompt_stream(task, 3, start), 30)) == whole[start : start + 30]
    shaped = with_reward(task, lambda prompt, completion: 0.0)  # a reward override keeps the position
    assert next(prompt_stream(shaped, 3, 17)) == whole[17]

    calls = []

    class Endless:  # a task whose prompts() takes no start: generated and dropped
        name = "endless"

        def prompts(self, seed: int) -> Any:
            for i in itertools.count():
                calls.append(i)
                yield Prompt(f"p{i}", "1+1=", "2")

    assert next(prompt_stream(Endless(), 0, 5)).task_id == "p5" and len(calls) == 6  # type: ignore[arg-type]


def _source(job: JobConfig, run_dir: Path, *, resume: bool = False) -> PromptSource:
    source = PromptSource("prompt_source", job=job)
    source.ctx = SimpleNamespace(run_dir=run_dir, log=logging.getLogger("test"), resume=resume)  # type: ignore[assignment]
    source.setup_state()
    source._open_journal()  # what setup does: recover from the lease journal, if any
    return source


def _issue(source: PromptSource, n: int) -> list[Prompt]:
    out = []
    for _ in range(n):
        item = source._next_prompt()
        if item is None:
            break
        out.append(item[0])
    return out


def test_a_resumed_prompt_source_continues_the_epoch_where_it_stopped(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", sums(80))
    job = JobConfig(
        task="dataset", task_kwargs={"path": str(data), "prompt_field": "q", "answer_field": "a", "epochs": 2}, seed=4
    )
    n = DatasetTask(str(data), prompt_field="q", answer_field="a").train_size
    first = _source(job, tmp_path)
    before = _issue(first, n // 3)
    first._compact_journal()  # what a stop does (a kill -9 leaves the log: the same state)

    resumed = _source(job, tmp_path, resume=True)
    after = _issue(resumed, 10 * n)  # to the end of the stream
    assert len(after) == 2 * n - len(before)  # epochs counted across the restart; then it stops
    epoch0 = before + after[: n - len(before)]
    assert sorted(p.task_id for p in epoch0) == sorted({p.task_id for p in epoch0})  # none repeated
    assert len(epoch0) == n and all(p.task_id.endswith("@e0") for p in epoch0)  # none skipped
    assert [p.task_id for p in epoch0] == [p.task_id for p in itertools.islice(first._task.prompts(4), n)]
    assert resumed._issued_tasks == 2 * n and resumed._next_prompt() is None
    for source in (first, resumed):
        assert source._journal is not None
        source._journal.close()


# -- the launcher's checks -----------------------------------------------------------------


def test_the_example_topology_is_the_main_one_with_two_lines_changed() -> None:
    main_lines = (ROOT / "examples" / "topology.toml").read_text().splitlines()
    example = EXAMPLE.read_text().splitlines()
    body = [line for line in example if not line.startswith("#")]
    changed = [line for line in body if line not in main_lines]
    assert [line.split("=")[0].strip() for line in changed] == ["task", "task_kwargs"], changed
    assert len([line for line in main_lines if not line.startswith("#")]) == len(body)
    task = load_task("dataset", **json.loads(json.dumps(_toml_job(EXAMPLE)["task_kwargs"])))
    assert isinstance(task, DatasetTask) and task.train_size + len(task.heldout(10_000)) == 500


def _toml_job(path: Path) -> dict[str, Any]:
    import tomllib

    return dict(tomllib.loads(path.read_text())["job"])


def _dry_run(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    args = [str(EXAMPLE), "--dry-run"]
    for override in overrides:
        args += ["--set", override]
    code = main(args)
    return code, capsys.readouterr().err


def _kwargs(**changes: Any) -> str:
    kwargs = {**_toml_job(EXAMPLE)["task_kwargs"], **changes}
    return "job.task_kwargs={ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in kwargs.items()) + " }"


def test_dry_run_checks_the_dataset_in_one_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the example's path is relative to the repository
    assert _dry_run(capsys) == (0, "")
    letters = write_jsonl(
        tmp_path / "letters.jsonl", [{"id": i, "question": f"{i}+x=", "answer": "1"} for i in range(40)]
    )
    cases = {
        _kwargs(path=str(tmp_path / "missing.jsonl")): "missing.jsonl: no such file or directory",
        _kwargs(prompt_field="text"): "addition500.jsonl: row 0 has no field 'text' (fields: id, question, answer,",
        _kwargs(heldout_fraction=0.0001): "the held-out split is empty",
        _kwargs(reward="no_such_module_x:reward"): "cannot import 'no_such_module_x:reward': ModuleNotFoundError",
        _kwargs(path=str(letters)): "job.task: prompt 'letters:0' of task 'letters' cannot be encoded for "
        "model 'built-in tiny': character 'x' at position 2",
    }
    for override, message in cases.items():
        code, err = _dry_run(capsys, override)
        assert code == 2, (override, err)
        assert err.count("\n") == 1 and err.startswith(f"{EXAMPLE}: job.task"), err
        assert message in err, (message, err)


def test_dry_run_catches_a_custom_task_that_fails_to_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_task_mod.py").write_text(
        textwrap.dedent(
            """
            def make():
                raise KeyError("no data here")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = _dry_run(capsys, 'job.task="broken_task_mod:make"', "job.task_kwargs={}")
    assert code == 2
    assert err == f"{EXAMPLE}: job.task_kwargs: task 'broken_task_mod:make': 'no data here'\n"


# -- end to end ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_the_shipped_dataset_trains_end_to_end_on_training_rows_only(tmp_path: Path) -> None:
    import torch

    from echo2.actors.buffer import Buffer
    from echo2.actors.learner import Learner, LearnerConfig
    from echo2.actors.rewarder import Rewarder
    from echo2.actors.sampler import Sampler, SamplerConfig
    from echo2.actors.weight_publisher import WeightPublisher
    from echo2.pipeline import Pipeline
    from echo2.rundir import RunDir

    torch.set_num_threads(1)
    kwargs = _toml_job(EXAMPLE)["task_kwargs"] | {"path": str(SHIPPED)}
    job = JobConfig(staleness=3, max_new_tokens=5, task="dataset", task_kwargs=kwargs)
    learner = Learner("learner", LearnerConfig(max_steps=6, eval_every=3, warmup_steps=2), job)
    actors = [
        PromptSource("prompt_source", job=job),
        Sampler("sampler", SamplerConfig(credits=16, max_batch_groups=16), job),
        Rewarder("rewarder", job=job),
        Buffer("buffer", job=job),
        learner,
        WeightPublisher("weight_publisher", job=job),
    ]
    async with Pipeline(actors, run_dir=tmp_path) as pipeline:
        await pipeline.wait()
    summary = json.loads(RunDir(tmp_path).summary_path.read_text())
    assert summary["steps"] == 6 and summary["rollouts_trained"] == 6 * 16 * 8
    assert (summary["eval_metric"], summary["eval_decoding"], summary["eval_prompts"]) == ("pass@1", "greedy", 115)
    assert [step for step, _ in summary["pass_at_1_by_step"]] == [0, 3, 6]
    assert summary["final_accuracy"] == summary["final_pass_at_1"]
    task = DatasetTask(**kwargs)
    training_ids = {f"{p.task_id}@e0" for p in task.every_prompt() if p not in task.heldout(10_000)}
    trained = learner.account.trained_tasks
    assert len(trained) == 6 * 16 and trained <= training_ids  # epoch 0, never a held-out row
