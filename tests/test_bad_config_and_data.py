"""Bad input caught where it enters (issue catalogue, part of tests/test_bad_input.py's family): ranges
of sampling fields, the run's length, answers that are not scalars, duplicate rows, demonstration
role order."""

import json

import pytest
from harness import module_and_data, quiet_trainer

from r3lightning.data.demonstrations import DemoConfig, load_chat_jsonl
from r3lightning.envs.math_env import MathSuite
from r3lightning.engines.base import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ],
)
def test_sampling_ranges_are_refused_at_parse_time(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_run_without_a_length_is_refused_before_training():
    module, dm = module_and_data()
    with pytest.raises(ValueError, match="trainer.max_steps is -1"):
        quiet_trainer(-1).fit(module, dm)
    assert module.global_step == 0


def test_a_warm_start_as_long_as_the_run_is_said():
    module, dm = module_and_data(sft_steps=2)
    with pytest.warns(UserWarning, match="this run is SFT only"):
        quiet_trainer(2).fit(module, dm)


@pytest.mark.parametrize("answer", [True, {"v": 1}, [3]], ids=["bool", "dict", "list"])
def test_answers_that_are_not_text_or_numbers_are_refused_naming_file_and_row(tmp_path, answer):
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"q{i}", "answer": "1"} for i in range(5)] + [{"question": "bad", "answer": answer}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=rf"data.jsonl.*row 6: field 'answer' is {type(answer).__name__}"):
        MathSuite(source=f"jsonl:{path}", num_val_tasks=2)


def test_duplicate_rows_are_dropped_and_reported(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"q{i % 6}", "answer": str(i % 6)} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.warns(UserWarning, match=r"4 rows repeat an earlier question and were dropped \(rows 7, 8, 9, 10\)"):
        suite = MathSuite(source=f"jsonl:{path}", num_val_tasks=2)
    val = {t.prompt for t in suite.val_tasks()}
    train = {suite.train_task(i).prompt for i in range(20)}
    assert len(val) == 2 and not val & train and len(train) == 4


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
         "message 2 is 'user' where 'assistant' was expected"),
        ([{"role": "assistant", "content": "c"}], "message 1 is 'assistant' where 'user' was expected"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "c"}], "message 2 is 'assistant'"),
    ],
    ids=["two-users", "assistant-first", "system-then-assistant"],
)
def test_demonstration_role_order_is_checked_when_the_file_is_read(tmp_path, messages, message):
    path = tmp_path / "demos.jsonl"
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path.write_text(json.dumps({"messages": good}) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(ValueError, match=rf"demos.jsonl, row 2: {message}"):
        load_chat_jsonl(str(path))


def test_a_bad_demonstration_file_stops_the_run_before_training(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "a"}]}) + "\n")
    module, dm = module_and_data(sft_steps=1)
    module.phases.warmstart.demos = DemoConfig(source=str(path))
    with pytest.raises(ValueError, match="demos.jsonl, row 1"):
        quiet_trainer(2).fit(module, dm)
    assert module.global_step == 0


def test_success_reflections_starting_after_the_warm_start_are_refused_naming_both_keys(tmp_path):
    """``r3l fit`` refuses the schedule before training (``PhaseSchedule.check``)."""
    import yaml
    from harness import TINY_CLI_RUN

    from r3lightning.cli.main import R3LightningCLI

    from r3lightning.training.phases import PhaseSchedule, WarmStartPhase

    def schedule(share: float, from_step: int) -> PhaseSchedule:
        demos = DemoConfig(reflections=True, success_reflection_share=share, success_reflection_from_step=from_step)
        return PhaseSchedule(WarmStartPhase(steps=2, demos=demos))

    assert schedule(0.25, 1).check(max_steps=4) is None
    assert schedule(0.0, 5).check(max_steps=4) is None
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY_CLI_RUN))
    demos = "--model.phases.warmstart.demos"
    with pytest.raises(ValueError, match=r"success_reflection_from_step \(2\) >= model.phases.warmstart.steps \(2\)"):
        R3LightningCLI(args=["fit", "--config", str(config), "--model.phases.warmstart.steps", "2", "--trainer.max_steps", "4",
                             f"{demos}.reflections", "true", f"{demos}.success_reflection_share", "0.25",
                             f"{demos}.success_reflection_from_step", "2"])
