"""Bad input catalogue: each case ends in a clear error or a counted fallback.

Covered elsewhere, not repeated here: a verifier that hangs or crashes (tests/envs/test_math_env.py),
malformed and empty dataset files at the suite level (test_math_env.py::test_dataset_errors),
context-limit truncation inside the agent loop and a hanging environment step in the loop
(tests/rollout/test_agent_loop.py), non-finite losses (tests/callbacks/test_health.py), resuming
with another model (tests/module/test_resume.py) or another config (tests/test_resume_mismatch.py),
damaged checkpoints, model directories and tokenizers (tests/test_bad_files.py). The whole catalogue,
by theme: docs/reliability.md.
"""

import dataclasses
import json
import re
import sys
import warnings
from unittest import mock

import pytest
import torch
from hanging_suite import HangingSuite
import yaml
from harness import ARITHMETIC, TINY_CLI_RUN, TINY_SPEC, LastStep, module_and_data, quiet_trainer

from r3lightning.callbacks.health import HealthWatchdog
from r3lightning import algos
from r3lightning.cli.main import main
from r3lightning.data.collate import collate_experience
from r3lightning.data.datamodule import RolloutDataModule, corpus_from_suite
from r3lightning.envs.math_env import MathSuite
from r3lightning.training.models import ModelConfig, build_tiny_model, build_tokenizer, load_pretrained
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.engines.base import Generation, SamplingParams
from r3lightning.rollout.explorers.base import ExplorerTraits, SampleExplorer
from r3lightning.types import Trajectory, Turn



# ---- configuration and files given to `r3l fit` ---------------------------------------------------
def run_cli(tmp_path, capsys, *args):
    with mock.patch.object(sys, "argv", ["r3l"]), pytest.raises(SystemExit) as exit_info:
        main(["fit", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false", *args])
    return exit_info.value.code, capsys.readouterr().err


def write(path, text):
    path.write_text(text)
    return str(path)


def test_malformed_yaml_names_the_file_and_line(tmp_path, capsys):
    config = write(tmp_path / "broken.yaml", "trainer:\n  max_steps: 2\n model: [\n")
    code, err = run_cli(tmp_path, capsys, "--config", config)
    assert code == 2
    assert f"config file {config!r} is not valid YAML at line 3" in err
    assert "Traceback" not in err


def test_a_key_given_twice_is_refused_naming_the_file_the_key_and_both_lines(tmp_path, capsys):
    config = write(tmp_path / "twice.yaml", "trainer:\n  max_steps: 2\nmodel:\n  optim:\n    lr: 0.1\n    lr: 0.2\n")
    code, err = run_cli(tmp_path, capsys, "--config", config)
    assert code == 2 and "Traceback" not in err
    assert f"r3l: error: config file {config!r} gives the key 'lr' twice, at line 5 and at line 6; keep one" in err


def test_a_key_given_twice_in_a_sections_file_names_that_file(tmp_path, capsys):
    data = write(tmp_path / "data.yaml", "group_size: 2\ntasks_per_step: 2\ngroup_size: 4\n")
    code, err = run_cli(tmp_path, capsys, "--data", data)
    assert code == 2 and f"r3l: error: config file {data!r} gives the key 'group_size' twice, at line 1 and at line 3" in err


def test_a_key_given_twice_in_yaml_read_by_jsonargparse_is_refused(tmp_path, capsys):
    """A YAML value on the command line goes through jsonargparse's loader, which refuses repeated keys too."""
    code, err = run_cli(tmp_path, capsys, "--trainer", "{max_steps: 2, max_steps: 3}")
    assert code == 2 and "the YAML value gives the key 'max_steps' twice, at line 1 and at line 1" in err


@pytest.mark.parametrize(
    "text, message",
    [
        ("trainer:\n  max_stepz: 2\n", "does not accept option 'trainer.max_stepz'"),
        ("model:\n  optim:\n    lr: fast\n", "Parser key \"model.optim.lr\""),
        ("trainer:\n  max_steps: two\n", "Expected a <class 'int'>. Got value: two"),
    ],
    ids=["unknown-key", "wrong-type-nested", "wrong-type"],
)
def test_unknown_keys_and_wrong_types_are_parser_errors(tmp_path, capsys, text, message):
    code, err = run_cli(tmp_path, capsys, "--config", write(tmp_path / "c.yaml", text))
    assert code == 2 and message in err and "Traceback" not in err


def test_nonexistent_model_path_is_one_clear_line(tmp_path, capsys):
    code, err = run_cli(
        tmp_path, capsys, "--model.model.name_or_path=/nonexistent", "--data.suite=r3lightning.envs.math_env.MathSuite",
        "--trainer.max_steps=1",
    )
    assert code == 1
    assert "r3l: error: model.name_or_path: no model directory at '/nonexistent'" in err
    assert "Traceback" not in err and "R3L_TRACEBACK=1" in err


@pytest.mark.parametrize(
    "rows, message",
    [([], "the dataset is empty"), ([{"question": "1+1?", "answer": "2"}, {"question": "2+2?"}], "row 2 has no 'answer' field")],
    ids=["empty", "missing-field"],
)
def test_dataset_errors_through_the_cli_name_file_row_and_field(tmp_path, capsys, rows, message):
    data = write(tmp_path / "data.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    code, err = run_cli(
        tmp_path, capsys, "--data.suite=r3lightning.envs.math_env.MathSuite", f"--data.suite.source=jsonl:{data}",
        "--data.suite.num_val_tasks=0",
    )
    assert code == 1 and f"{data}: {message}" in err and "Traceback" not in err


def test_a_fit_stopped_by_non_finite_steps_exits_3_naming_the_checkpoint(tmp_path, capsys, monkeypatch):
    from r3lightning.module import R3LightningModule

    original = R3LightningModule.micro_batch_loss

    def poisoned(self, micro, totals):
        out = original(self, micro, totals)
        out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(R3LightningModule, "micro_batch_loss", poisoned)
    recipe = write(tmp_path / "tiny.yaml", yaml.safe_dump(TINY_CLI_RUN))
    code, err = run_cli(tmp_path, capsys, "--config", recipe, "--trainer.max_steps=5", "--model.max_bad_steps=2")
    stop = tmp_path / "checkpoints" / "bad_steps_stop.ckpt"
    assert code == 3 and stop.is_file()  # skipped steps do not count as optimizer steps: global step 0
    assert err.strip().splitlines()[-1] == (
        "r3l: error: training stopped unhealthy at global step 0: 2 consecutive steps with non-finite loss or gradients "
        f"(model.max_bad_steps=2; see train/skipped_steps); the last good weights are in {stop}"
    )


def test_tokenizer_without_chat_template(tmp_path):
    tokenizer = build_tokenizer(["What is 1+1?", "\\boxed{2}"] * 4, vocab_size=TINY_SPEC.vocab_size)
    model = build_tiny_model(TINY_SPEC, tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="tokenizer has no chat template; set model.model.chat_template"):
        ChatFormatter(tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no chat template; set model.model.chat_template"):
        load_pretrained(ModelConfig(name_or_path=str(tmp_path)))
    from r3lightning.training.models import CHATML_TEMPLATE

    _, loaded = load_pretrained(ModelConfig(name_or_path=str(tmp_path), chat_template=CHATML_TEMPLATE))
    assert ChatFormatter(loaded).first_prompt("hi")


# ---- rollouts that go wrong during training ---------------------------------------------------------
def fit(suite, steps=1, agent=None, algorithm=None, callbacks=(), max_new_tokens=6, tmp_path=None, explorer=None):
    """Train ``steps`` steps; the last step's ``StepOutput`` and the logged scalars."""
    module, dm = module_and_data(
        suite, explorer=explorer, max_new_tokens=max_new_tokens, agent=agent,
        algorithm=algorithm or AlgorithmConfig(policy_loss="ppo_clip"), micro_batch_size=3,
    )
    last = LastStep()
    trainer = quiet_trainer(steps, callbacks=[*callbacks, last], default_root_dir=tmp_path)
    trainer.fit(module, dm)
    assert trainer.global_step == steps and module.skipped_steps == 0
    return last.output, {k: float(v) for k, v in trainer.callback_metrics.items()}


def test_hanging_reward_is_cut_masked_counted_and_training_completes(tmp_path, capsys):
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=128, step_timeout_s=0.3)
    step, metrics = fit(HangingSuite(), steps=2, agent=agent, callbacks=[HealthWatchdog()], tmp_path=tmp_path)
    assert metrics["reward/error_rate"] == 0.5 and metrics["rollout/env_error_rate"] == 0.5
    hung = [t for t in step["trajectories"] if t.reward_error]
    assert len(hung) == 4 and all("did not return within 0.3s" in t.env_error for t in hung)
    assert metrics["reward/mean"] == 0.5  # the hung samples count as reward 0 and are masked out of the loss
    assert "health warning (reward_errors)" in capsys.readouterr().out


def test_pivot_out_of_range_masks_everything_without_crashing(monkeypatch):
    turn_index = torch.tensor([[-1, -1, 0, 0, -1, 1, 1]])
    assert not algos.pivotal_mask(turn_index, torch.tensor([5])).any()
    trajectory = Trajectory("t", [Turn([1, 2], [3, 4], [0.0, 0.0]), Turn([5], [6], [0.0])], pivot=9)
    batch = collate_experience([trajectory], [1.0], pad_token_id=0, pivotal_credit=True)
    assert batch.loss_mask.sum() == 0 and batch.advantages.abs().sum() == 0

    # A whole training step whose every trajectory has its pivot past its last turn: no RL tokens, no crash.
    class PivotPastTheEnd(SampleExplorer):
        traits = ExplorerTraits(sets_pivots=True)

        def explore(self, tasks, loop, spec):
            exploration = super().explore(tasks, loop, spec)
            for t in exploration.trajectories:
                t.pivot = len(t.turns) + 3
            return exploration

    _, metrics = fit(
        MathSuite(**ARITHMETIC), algorithm=AlgorithmConfig(policy_loss="ppo_clip", pivotal_credit=True), explorer=PivotPastTheEnd()
    )
    assert metrics["train/rl_tokens"] == 0 and metrics["train/loss"] == 0


class EmptyEngine:
    """An engine that returns zero tokens for every prompt."""

    weight_version = 0

    def generate(self, prompts, params):
        return [Generation(token_ids=[], logprobs=[], finish_reason="stop") for _ in prompts]


def test_empty_generations_are_handled_by_loop_collator_and_step(monkeypatch):
    suite = MathSuite(**ARITHMETIC)
    config = AgentLoopConfig(action_format="raw")
    tokenizer = build_tokenizer(corpus_from_suite(suite, config, num_tasks=8), vocab_size=TINY_SPEC.vocab_size)
    loop = AgentLoop(suite, EmptyEngine(), tokenizer, config)
    trajectories = loop.run([EpisodeRequest(task=suite.train_task(i)) for i in range(2)], SamplingParams())
    for t in trajectories:
        assert t.turns[0].response_ids == [] and t.reward == 0.0 and not t.success and t.end_reason == "done"
    batch = collate_experience(trajectories, [1.0, -1.0], tokenizer.pad_token_id)
    assert batch.loss_mask.sum() == 0

    monkeypatch.setattr("r3lightning.module.build_engine", lambda config, policy, tokenizer, context_tokens=0: EmptyEngine())
    _, metrics = fit(suite)
    assert metrics["rollout/response_len"] == 0 and metrics["train/rl_tokens"] == 0


def test_a_context_that_cannot_hold_a_prompt_and_an_answer_is_refused_at_setup():
    with pytest.raises(ValueError, match=r"data.agent.max_context_tokens \(5\) cannot hold task .*prompt \(\d+ tokens\).*at least \d+"):
        fit(MathSuite(**ARITHMETIC), agent=AgentLoopConfig(action_format="raw", max_context_tokens=5))


class OneLongRowSuite(MathSuite):
    """Arithmetic whose training task 0 (a row among the first the setup check samples, and drawn by the
    first step) has a prompt of thousands of tokens: an outlier row, as a 10 MB row of a JSONL file is."""

    def train_task(self, index):
        task = super().train_task(index)
        if index == 0:
            return dataclasses.replace(task, task_id="jsonl:tasks.jsonl#row0", prompt=" ".join(str(i) for i in range(3000)))
        return task


def test_one_overlong_row_among_the_first_tasks_is_skipped_and_named_once_not_fatal(tmp_path):
    """The same treatment wherever the row falls: among the tasks the setup check samples it no longer
    refuses the run; it is warned about once, by task id (file and row), and the rollouts that draw it
    skip it and count it in rollout/prompt_too_long_rate."""
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, metrics = fit(OneLongRowSuite(**ARITHMETIC), steps=1, agent=agent, tmp_path=tmp_path)
    named = [str(w.message) for w in caught if "jsonl:tasks.jsonl#row0" in str(w.message)]
    assert len(named) == 1, named
    assert re.fullmatch(
        r"task 'jsonl:tasks.jsonl#row0': its first prompt \(\d+ tokens\) does not fit in data.agent.max_context_tokens "
        r"\(256\); its episodes are skipped .*rollout/prompt_too_long_rate\). Drop or shorten that row, or raise "
        r"data.agent.max_context_tokens", named[0],
    ), named[0]
    skipped = [t for t in step["trajectories"] if t.task_id == "jsonl:tasks.jsonl#row0"]
    assert skipped and all(not t.turns and t.end_reason == "context_limit" for t in skipped)
    assert 0 < metrics["rollout/prompt_too_long_rate"] < 1


# The setup check samples the first tasks' first prompts; later tasks, later turns and what explorers add
# can still overflow at run time. The two tests below switch the check off to reach that path.
def test_overlong_generations_are_cut_at_the_context_limit_and_counted(monkeypatch):
    monkeypatch.setattr(RolloutDataModule, "check_prompt_room", lambda self: None)
    suite = MathSuite(**ARITHMETIC)
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=128)
    tokenizer = build_tokenizer(corpus_from_suite(suite, agent), TINY_SPEC.vocab_size)  # what configure_model builds
    chat = ChatFormatter(tokenizer, suite.system_prompt)
    longest_prompt = max(len(chat.first_prompt(suite.train_task(i).prompt)) for i in range(2))
    limit = longest_prompt + 3
    step, metrics = fit(suite, agent=AgentLoopConfig(action_format="raw", max_context_tokens=limit), max_new_tokens=12)
    assert metrics["rollout/truncated_rate"] == 1.0 and metrics["rollout/prompt_too_long_rate"] == 0.0
    for t in step["trajectories"]:
        assert t.end_reason == "context_limit" and len(t.token_ids()) <= limit
        assert 0 < t.num_response_tokens <= 3


def test_prompts_longer_than_the_context_end_the_episode_and_are_counted(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(RolloutDataModule, "check_prompt_room", lambda self: None)
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=5)
    step, metrics = fit(MathSuite(**ARITHMETIC), steps=2, agent=agent, callbacks=[HealthWatchdog()], tmp_path=tmp_path)
    assert all(not t.turns and t.end_reason == "context_limit" for t in step["trajectories"])
    assert metrics["rollout/prompt_too_long_rate"] == 1.0 and metrics["rollout/truncated_rate"] == 1.0
    assert metrics["train/rl_tokens"] == 0
    assert "health warning (prompt_too_long)" in capsys.readouterr().out
