"""Prompts become token ids by one rule, ``job.prompt_format``, on every side of a run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")

from tests.test_hf_models import CHARS, make_tiny_llama

from echo2.actors.admission import trusted_prompt_codec
from echo2.errors import ConfigError
from echo2.job import JobConfig, PromptFormat
from echo2.models.identity import model_identity
from echo2.models.location import load_prompt_tokenizer, locate_model
from echo2.topology.preflight import check_prompts_encode

# Roles and the thinking switch in the shape of real templates (Qwen3: enable_thinking),
# with markers from the test tokenizer's character vocabulary.
THINKING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}<s>s {{ m['content'] }}.{% endif %}"
    "{% if m['role'] == 'user' %}<s>u {{ m['content'] }}.{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<s>a {% if enable_thinking is defined and not enable_thinking %}"
    "nothink {% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_tiny_llama(tmp_path_factory.mktemp("chat"), chat=True)
    config = directory / "tokenizer_config.json"
    import json

    settings = json.loads(config.read_text())
    settings["chat_template"] = THINKING_TEMPLATE
    config.write_text(json.dumps(settings))
    (directory / "chat_template.jinja").unlink(missing_ok=True)  # transformers 5 saves it apart
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return directory


def _decode(ids: list[int]) -> str:
    vocab = ["<pad>", "<s>", "</s>", *CHARS]
    return "".join(vocab[i] for i in ids)


def _render(model: Path, **fmt: str) -> str:
    tokenizer = load_prompt_tokenizer(locate_model(str(model)), PromptFormat(**fmt))  # type: ignore[arg-type]
    return _decode(tokenizer.encode_prompt("what is 1+2?"))


def test_the_system_prompt_and_the_thinking_switch_reach_the_ids(chat_model: Path) -> None:
    assert _render(chat_model) == "<s>u what is 1+2?.<s>a "
    assert _render(chat_model, system_prompt="be brief") == "<s>s be brief.<s>u what is 1+2?.<s>a "
    assert _render(chat_model, thinking="off") == "<s>u what is 1+2?.<s>a nothink "
    assert _render(chat_model, thinking="on") == "<s>u what is 1+2?.<s>a "
    assert _render(chat_model, chat_template="off") == "what is 1+2?"  # plain (this tokenizer adds no BOS)


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ({"chat_template": "on"}, 'chat_template = "on", but the model\'s tokenizer has no chat template'),
        ({"system_prompt": "hi"}, "system_prompt needs a chat template"),
        ({"thinking": "off"}, "has no thinking switch (enable_thinking)"),
    ],
)
def test_a_format_the_model_cannot_render_is_one_line_at_preflight(
    tmp_path: Path, fmt: dict[str, str], message: str
) -> None:
    from echo2.tasks.addition import AdditionTask

    plain = make_tiny_llama(tmp_path / "plain")  # no chat template at all
    with pytest.raises(ConfigError, match=r"job\.prompt_format") as raised:
        check_prompts_encode(AdditionTask(), str(plain), PromptFormat(**fmt))  # type: ignore[arg-type]
    assert message in str(raised.value)


def test_the_tiny_model_refuses_a_chat_format_at_preflight() -> None:
    from echo2.tasks.addition import AdditionTask

    with pytest.raises(ConfigError, match=r"job\.prompt_format: the tiny model has no chat template"):
        check_prompts_encode(AdditionTask(), "", PromptFormat(system_prompt="be brief"))


def test_trusted_side_and_engine_render_the_same_ids_and_the_format_is_part_of_the_identity(chat_model: Path) -> None:
    from echo2.engines.hf_engine import HFTorchEngine

    job = JobConfig(model=str(chat_model), prompt_format=PromptFormat(system_prompt="be brief", thinking="off"))
    engine = HFTorchEngine(str(chat_model), prompt_format=job.prompt_format)
    try:
        prompt = "what is 2+2?"
        assert trusted_prompt_codec(job).encode(prompt) == engine.tokenizer.encode_prompt(prompt)
        assert engine.model_identity() == model_identity(job.model, job.prompt_format)
        # A sampler rendering prompts any other way serves another identity: refused at Welcome.
        assert engine.model_identity() != model_identity(job.model, PromptFormat(thinking="off"))
        assert engine.model_identity() != model_identity(job.model)
    finally:
        engine.close()
