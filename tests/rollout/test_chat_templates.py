"""Chat templates: ``model.model.chat_template`` (text, a file, or the shipped ``qwen3_prefix_stable``)
replaces the tokenizer's own; a template that is not prefix-stable serves single-turn tasks and is
refused, naming ``model.model.chat_template``, only where a second user message must be booked.

The Qwen-style templates below are written for these tests (the models' own files are not the project's
to ship); each reproduces the behaviour of its family's template that matters here: Qwen2.5's adds a
default system message; Qwen3's gives the assistant message after the last user message a think block
and drops the reasoning of earlier ones, so it is not prefix-stable. With ``R3L_REAL_CHAT_TEMPLATES`` set
to a folder holding the models' own templates as ``qwen2.5.jinja`` and ``qwen3.jinja`` (the
``chat_template`` field of each model's ``tokenizer_config.json``), every test below also runs on them
(docs/configuration.md, "Chat templates")."""

import copy
import os
import sys
from pathlib import Path

import pytest
import yaml
from harness import TINY_CLI_RUN, TINY_SPEC

from r3lightning.envs.math_env import MathSuite
from r3lightning.training.models import (
    ModelConfig,
    build_tiny_model,
    build_tokenizer,
    chat_template_text,
    load_pretrained,
)
from r3lightning.rollout.agent_loop import AgentLoop
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.engines.hf.engine import HFEngine

QWEN25_STYLE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set answer = message['content'].split('</think>')[-1].lstrip('\\n') -%}"
    "{%- set reasoning = message['content'].split('</think>')[0].split('<think>')[-1].strip('\\n') if '</think>' in message['content'] else '' -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
REAL_TEMPLATES_ENV = "R3L_REAL_CHAT_TEMPLATES"


def template_families():
    """The written-here pair always; the models' own pair too when ``R3L_REAL_CHAT_TEMPLATES`` names them."""
    families = [pytest.param({"qwen2.5": QWEN25_STYLE, "qwen3": QWEN3_STYLE}, id="written-here")]
    folder = os.environ.get(REAL_TEMPLATES_ENV)
    if folder:
        paths = {name: Path(folder, f"{name}.jinja") for name in ("qwen2.5", "qwen3")}
        missing = [str(path) for path in paths.values() if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"{REAL_TEMPLATES_ENV}={folder!r}: no {', '.join(missing)}")
        families.append(pytest.param({name: path.read_text() for name, path in paths.items()}, id="models-own"))
    return families


family = pytest.mark.parametrize("templates", template_families())
CORPUS = ["What is 1+1?", "\\boxed{2}", "You are a helpful assistant.", "<think>", "</think>"] * 4


def tokenizer_with(template):
    tokenizer = build_tokenizer(CORPUS, vocab_size=TINY_SPEC.vocab_size)
    tokenizer.chat_template = template
    return tokenizer


@family
def test_the_qwen3_template_is_not_prefix_stable_and_the_shipped_one_is(templates):
    assert ChatFormatter(tokenizer_with(templates["qwen2.5"]), "sys").prefix_stable
    assert not ChatFormatter(tokenizer_with(templates["qwen3"]), "sys").prefix_stable
    shipped = tokenizer_with(chat_template_text("qwen3_prefix_stable"))
    assert ChatFormatter(shipped, "sys").prefix_stable
    # The shipped template writes a first prompt as Qwen3's does, thinking on or off.
    qwen3 = tokenizer_with(templates["qwen3"])
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 1+1?"}]
    for extra in ({}, {"enable_thinking": False}):
        render = dict(tokenize=False, add_generation_prompt=True, **extra)
        assert shipped.apply_chat_template(messages, **render) == qwen3.apply_chat_template(messages, **render)
    # Qwen3's drops earlier reasoning; the shipped one keeps the text the model wrote.
    turns = [*messages, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"}, {"role": "user", "content": "Again?"}]
    assert "add" not in qwen3.apply_chat_template(turns, tokenize=False)
    assert "<think>\nadd\n</think>\n\n2<|im_end|>" in shipped.apply_chat_template(turns, tokenize=False)


@family
def test_single_turn_tasks_play_with_any_template_and_multi_turn_ones_refuse_naming_the_key(templates):
    single, multi = MathSuite(source="arithmetic", num_val_tasks=2), MathSuite(source="arithmetic", num_val_tasks=2, max_attempts=2)
    for template in templates.values():
        tokenizer = tokenizer_with(template)
        policy = build_tiny_model(TINY_SPEC, tokenizer)
        loop = AgentLoop(single, HFEngine(policy, tokenizer), tokenizer)
        first = loop.chat.first_prompt("What is 1+1?")
        assert tokenizer.decode(first).endswith("<|im_start|>assistant\n")
    tokenizer = tokenizer_with(templates["qwen3"])
    with pytest.raises(ValueError, match=r"not prefix-stable .* \(MathSuite\) plays up to 2 turns.*set model\.model\.chat_template.*qwen3_prefix_stable"):
        AgentLoop(multi, HFEngine(build_tiny_model(TINY_SPEC, tokenizer), tokenizer), tokenizer)
    shipped = tokenizer_with(chat_template_text("qwen3_prefix_stable"))
    AgentLoop(multi, HFEngine(build_tiny_model(TINY_SPEC, shipped), shipped), shipped)


def test_the_configured_template_replaces_the_tokenizer_own(tmp_path):
    tokenizer = tokenizer_with(QWEN25_STYLE)
    build_tiny_model(TINY_SPEC, tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "qwen3.jinja").write_text(QWEN3_STYLE)
    for setting, expected in ((QWEN3_STYLE, QWEN3_STYLE), (str(tmp_path / "qwen3.jinja"), QWEN3_STYLE),
                              ("qwen3_prefix_stable", chat_template_text("qwen3_prefix_stable")), (None, QWEN25_STYLE)):
        _, loaded = load_pretrained(ModelConfig(name_or_path=str(tmp_path / "model"), chat_template=setting))
        assert loaded.chat_template == expected
    with pytest.raises(FileNotFoundError, match="model.model.chat_template: 'qwen4' is neither template text.*qwen3_prefix_stable"):
        chat_template_text("qwen4")


def run_r3l(tmp_path, monkeypatch, config):
    from r3lightning.cli.main import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["r3l", "fit", "--config", str(path)])
    main()


@family
def test_a_qwen3_template_trains_a_single_turn_task_and_a_multi_turn_one_is_refused(templates, tmp_path, monkeypatch, capsys):
    config = copy.deepcopy(TINY_CLI_RUN)
    config["model"]["model"]["chat_template"] = templates["qwen3"]
    config["trainer"]["max_steps"] = 2
    run_r3l(tmp_path, monkeypatch, config)  # returns: two steps trained
    config["data"]["suite"]["init_args"]["max_attempts"] = 2
    with pytest.raises(SystemExit) as exit_:
        run_r3l(tmp_path, monkeypatch, config)
    assert exit_.value.code == 1
    error = capsys.readouterr().err
    assert error.startswith("r3l: error: the chat template is not prefix-stable") and "set model.model.chat_template" in error
