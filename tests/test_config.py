"""Config values that fail at load: every enumerated value and every import path of a topology.

A typo in a value drawn from a fixed set (a ``Literal``), in a name that stands for code
(actor kind, task, reward) or a value out of bounds must stop ``python -m echo2.launch ...
--dry-run`` with exit 2 and one line naming the field, before anything starts, and not
fail later inside a child. Every config field also carries a one-line meaning.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec.inspect as mi
import pytest

from echo2.actors import load_actor_class
from echo2.errors import ConfigError
from echo2.job import EpisodeConfig, JobConfig
from echo2.launch import main
from echo2.registry import ACTORS
from echo2.topology import ActorSpec, HostSpec, ProcessSpec, RunSpec, SecuritySpec, load_topology

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "examples" / "topology.toml"  # all six actors, declared processes

# override -> the one line load_topology reports (the launcher prefixes "<file>: ").
ENUM_TYPOS = {
    "actors.learner.config.old_policy": (
        "learnr",
        "Expected one of 'learner', 'sampler', got 'learnr'",
    ),
    "actors.learner.config.loss": (
        "gpso",
        "Expected one of 'cispo', 'geo_sequence_mask', 'gspo', 'ppo_is', 'tis_sequence_mask', 'tis_token_mask', "
        "got 'gpso'",
    ),
    "actors.learner.config.lr_schedule": ("cosine", "Expected one of 'constant', 'linear', got 'cosine'"),
    "actors.learner.config.model_dtype": (
        "bfloat",
        "Expected one of 'bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32', got 'bfloat'",
    ),
    "actors.sampler.config.engine": ("vlm", "Expected one of 'hf', 'simulated', 'torch', 'vllm', got 'vlm'"),
    "actors.sampler.config.weights_data_plane": ("tcp", "Expected one of 'stream', 'zmq', got 'tcp'"),
    "actors.weight_publisher.config.mode": ("chain", "Expected one of 'relay', 'star', 'striped', got 'chain'"),
    "actors.weight_publisher.config.publication": ("adapt", "Expected one of 'adaptive', 'every', got 'adapt'"),
    "actors.prompt_source.config.journal_fsync": ("fsync", "Expected one of 'always', 'none', got 'fsync'"),
    "actors.buffer.config.journal_fsync": ("sync", "Expected one of 'always', 'none', got 'sync'"),
    "actors.prompt_source.config.activation": (
        "cost-aware",
        "Expected one of 'all', 'cost_aware', 'random', got 'cost-aware'",
    ),
    "processes.learner.restart": ("always", "Expected one of 'never', 'on-failure', got 'always'"),
    "run.wandb_mode": ("disabled", "Expected one of 'offline', 'online', got 'disabled'"),
}

IMPORT_PATH_TYPOS = [
    ("actors.learner.kind", "lerner", "unknown kind 'lerner' (known: buffer, counter_sink, "),
    ("actors.learner.kind", '"no_such_pkg:Learner"', "cannot import 'no_such_pkg:Learner': ModuleNotFoundError: "),
    ("job.task", "addtion", "unknown task 'addtion' (known: addition, dataset, math_answer, reasoning_gym; or "),
    ("job.task", '"echo2.tasks.addition:AdditionTsk"', "cannot import 'echo2.tasks.addition:AdditionTsk': "),
    ("job.task", '"echo2.tasks.addition:hashlib"', "'echo2.tasks.addition:hashlib' is not a class or function"),
    ("job.task_kwargs", "{ digts = 3 }", "'addition': got an unexpected keyword argument 'digts'"),
    (
        "job.reward",
        "exakt",
        "unknown reward 'exakt' (known: code_tests, exact, math_answer, math_verify; or 'package.module:function')",
    ),
    ("job.reward", '"echo2.tasks.math_answer:nope"', "cannot import 'echo2.tasks.math_answer:nope': AttributeError"),
]

BOUND_TYPOS = [
    ("actors.learner.config.lr", "-3e-4", "Expected `float` >= 0.0"),
    ("actors.learner.config.log_every", "0", "Expected `int` >= 1"),
    ("actors.sampler.config.credits", "0", "Expected `int` >= 1"),
    ("actors.sampler.config.restate_s", "0", "Expected `float` > 0.0"),
    ("actors.rewarder.config.item_timeout_s", "0", "Expected `float` > 0.0"),
    ("actors.prompt_source.config.gamma", "0.9", "Expected `float` >= 1.0"),
    ("actors.weight_publisher.config.send_timeout_s", "-1", "Expected `float` > 0.0"),
    ("actors.buffer.config.max_groups", "0", "Expected `int` >= 1"),
    ("actors.buffer.config.journal_compact_records", "0", "Expected `int` >= 1"),
    ("actors.buffer.config.journal", '"yes"', "Expected `bool`, got `str`"),
    ("actors.prompt_source.config.journal", "1", "Expected `bool`, got `int`"),
    ("actors.learner.config.batch_resend_s", "0", "Expected `float` > 0.0"),
]


def load_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_topology(MAIN, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("field", sorted(ENUM_TYPOS))
def test_enumerated_value_typo_names_the_field_and_the_choices(field: str) -> None:
    typo, expected = ENUM_TYPOS[field]
    assert load_error(f"{field}={typo}") == f"{field}: {expected}"


@pytest.mark.parametrize(("field", "value", "expected"), IMPORT_PATH_TYPOS, ids=lambda v: str(v)[:30])
def test_import_path_that_does_not_resolve_names_the_field(field: str, value: str, expected: str) -> None:
    assert load_error(f"{field}={value}").startswith(f"{field}: {expected}")


@pytest.mark.parametrize(("field", "value", "expected"), BOUND_TYPOS, ids=lambda v: str(v)[:40])
def test_value_out_of_bounds_names_the_field(field: str, value: str, expected: str) -> None:
    assert load_error(f"{field}={value}") == f"{field}: {expected}"


def test_every_enumerated_field_has_a_typo_case() -> None:
    """A Literal field added to a built-in actor or the topology needs a case above."""
    topology = load_topology(MAIN)
    literal_fields = set()
    for actor in topology.actors.values():
        for name in _literal_fields(actor.cls.Config):
            literal_fields.add(f"actors.{actor.spec}.config.{name}")
    for name in _literal_fields(ProcessSpec):
        literal_fields.add(f"processes.learner.{name}")
    for spec, table in ((RunSpec, "run"), (JobConfig, "job"), (HostSpec, "hosts.local"), (SecuritySpec, "security")):
        literal_fields.update(f"{table}.{name}" for name in _literal_fields(spec))
    assert literal_fields == set(ENUM_TYPOS)


def _literal_fields(struct: type) -> list[str]:
    info = mi.type_info(struct)
    assert isinstance(info, mi.StructType)
    return [f.name for f in info.fields if isinstance(f.type, mi.LiteralType)]


def test_typo_on_the_command_line_exits_2_with_one_line_and_starts_nothing(tmp_path: Path) -> None:
    for override in ("actors.learner.config.old_policy=learnr", "job.task=addtion"):
        result = subprocess.run(
            [sys.executable, "-m", "echo2.launch", str(MAIN), "--dry-run", "--set", override],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        field = override.partition("=")[0]
        assert result.returncode == 2, result.stderr
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{MAIN}: {field}: ")
    # Without --dry-run the same typo stops the launcher before it makes a run directory.
    assert main([str(MAIN), "--run-dir", str(tmp_path), "--set", "actors.sampler.config.engine=vlm"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_custom_task_resolves_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tasks_for_load.py").write_text(
        textwrap.dedent(
            """
            from echo2.tasks.addition import AdditionTask

            def make(digits: int = 2, *, tag: str = "") -> AdditionTask:
                return AdditionTask(digits)

            def reward(prompt, completion) -> float:
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = ['job.task="my_tasks_for_load:make"', "job.task_kwargs={ tag = 'x' }", 'job.reward="my_tasks_for_load:reward"']
    assert load_topology(MAIN, ok).job.task == "my_tasks_for_load:make"
    assert load_error(*ok[:1], "job.task_kwargs={ width = 2 }") == (
        "job.task_kwargs: 'my_tasks_for_load:make': got an unexpected keyword argument 'width'"
    )


# The GPU recipes name a model directory and GPUs this machine lacks: tests/test_launch_torchrun.py
# dry-runs them with a stand-in model and ECHO2_ASSUME_GPUS.
@pytest.mark.parametrize(
    "path",
    sorted(set((ROOT / "examples").glob("*.toml")) - set((ROOT / "examples").glob("gpu*.toml"))),
    ids=lambda p: p.name,
)
def test_examples_dry_run(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosts = list(load_topology(path).hosts)
    # A multi-host example names no host of this machine: each host's launcher is started with --host.
    for host_args in [[]] if len(hosts) == 1 else [["--host", host] for host in hosts]:
        assert main([str(path), "--dry-run", *host_args]) == 0, capsys.readouterr().err
        assert '"run_id": ' in capsys.readouterr().out


# -- every field has a one-line meaning ----------------------------------------------------


def _config_structs() -> list[type]:
    structs: list[type] = [JobConfig, EpisodeConfig, RunSpec, HostSpec, ProcessSpec, ActorSpec, SecuritySpec]
    structs += [load_actor_class(kind).Config for kind in ACTORS.names()]
    return list(dict.fromkeys(structs))


@pytest.mark.parametrize("struct", _config_structs(), ids=lambda s: s.__qualname__)
def test_every_config_field_has_a_docstring(struct: type) -> None:
    seen, undocumented = [], []
    # base classes first (a subclass's fields follow its bases', as msgspec orders them)
    for owner in reversed([c for c in struct.__mro__ if inspect.get_annotations(c)]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
        (cls,) = tree.body
        assert isinstance(cls, ast.ClassDef)
        for field, following in zip(cls.body, [*cls.body[1:], None], strict=True):
            if not isinstance(field, ast.AnnAssign) or not isinstance(field.target, ast.Name):
                continue
            seen.append(field.target.id)
            if not (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
                undocumented.append(field.target.id)
    assert seen == list(struct.__struct_fields__)  # the walk saw every field
    assert undocumented == []
