"""A suite declares how its environment reads a response (``TaskSuite.answer_format``) and the agent
loop's ``data.agent.action_format`` must agree: math answers raw, so the default (unset) takes the
suite's format, and an explicit contradiction is refused when the datamodule is built (``r3l`` names
both keys and the fix) instead of training on rewards that are all 0."""

import copy
import sys

import pytest
from harness import ARITHMETIC, TINY_CLI_RUN
from digit_suite import DigitSuite

from r3lightning.data.datamodule import RolloutDataModule
from r3lightning.envs.math_env import MathSuite
from r3lightning.rollout.agent_loop import AgentLoopConfig, resolve_action_format


def test_math_suites_declare_raw_answers_and_worlds_declare_none():
    assert MathSuite(**ARITHMETIC).answer_format == "raw"
    assert DigitSuite().answer_format is None


def test_unset_action_format_takes_the_suite_answer_format():
    assert resolve_action_format(MathSuite(**ARITHMETIC), AgentLoopConfig()).action_format == "raw"
    assert resolve_action_format(DigitSuite(), AgentLoopConfig()).action_format == "tag"
    assert resolve_action_format(DigitSuite(), AgentLoopConfig(action_format="line")).action_format == "line"
    data = RolloutDataModule(MathSuite(**ARITHMETIC))
    assert data.agent.action_format == "raw"


def test_a_contradicting_action_format_is_refused_when_the_datamodule_is_built():
    with pytest.raises(ValueError) as error:
        RolloutDataModule(MathSuite(**ARITHMETIC), agent=AgentLoopConfig(action_format="tag"))
    message = str(error.value)
    for part in ("data.agent.action_format", "'tag'", "MathSuite", "answer_format", "'raw'", "data.agent.action_format: raw"):
        assert part in message, message


def test_r3l_refuses_a_math_suite_with_tag_actions_in_one_line(tmp_path, monkeypatch, capsys):
    from r3lightning.cli.main import main

    config = copy.deepcopy(TINY_CLI_RUN)
    config["data"]["agent"]["action_format"] = "tag"
    path = tmp_path / "run.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["r3l", "fit", "--config", str(path)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    error = capsys.readouterr().err
    assert error.startswith("r3l: error: data.agent.action_format is 'tag'"), error
    assert "MathSuite" in error and "data.agent.action_format: raw" in error
