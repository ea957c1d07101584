"""The phase schedule (``model.phases``): which phase a step is in, and the keys it replaced."""

import pytest
from harness import BASE_RECIPE

from r3lightning.cli.main import main
from r3lightning.data.demonstrations import DemoConfig
from r3lightning.training.phases import REPLACED_KEYS, PhaseSchedule, WarmStartPhase


def test_each_step_has_one_phase_and_a_validation_measures_the_phase_before_it():
    schedule = PhaseSchedule(WarmStartPhase(steps=3, lr=0.5, validate=False))
    assert [schedule.at(s).name for s in range(5)] == ["warmstart"] * 3 + ["rl"] * 2
    assert [schedule.before(s).name for s in (0, 3, 4)] == ["warmstart", "warmstart", "rl"]
    warm, rl = schedule.phases()
    assert (warm.samples, warm.lr, warm.validate, warm.end) == ("demonstrations", 0.5, False, 3)
    assert (rl.samples, rl.lr, rl.validate, rl.start, rl.end, rl.is_rl) == ("rollouts", None, True, 3, None, True)
    assert [schedule.rl_begins_after_warmstart(s) for s in (2, 3, 4)] == [False, True, False]
    assert [schedule.past_warmstart(s) for s in (3, 4)] == [False, True]
    assert schedule.demonstrations() is schedule.warmstart.demos


def test_without_a_warm_start_every_step_is_rl_and_no_demonstrations_are_made():
    schedule = PhaseSchedule()
    assert [p.name for p in schedule.phases()] == ["rl"]
    assert schedule.demonstrations() is None
    assert not schedule.rl_begins_after_warmstart(0) and not schedule.past_warmstart(5)


def test_the_schedule_refuses_success_reflections_after_the_warm_start_and_names_an_sft_only_run():
    late = DemoConfig(reflections=True, success_reflection_share=0.5, success_reflection_from_step=4)
    with pytest.raises(ValueError, match=r"success_reflection_from_step \(4\) >= model.phases.warmstart.steps \(4\)"):
        PhaseSchedule(WarmStartPhase(steps=4, demos=late)).check(max_steps=10)
    assert "SFT only" in PhaseSchedule(WarmStartPhase(steps=4)).check(max_steps=4)
    with pytest.raises(ValueError, match="warmstart.steps must be >= 0"):
        WarmStartPhase(steps=-1)


@pytest.mark.parametrize("old, value", [
    ("model.phases.sft_warmup_steps", "3"),
    ("model.phases.validate_during_sft", "false"),
    ("model.phases.reset_optimizer_for_rl", "false"),
    ("model.optim.sft_lr", "0.1"),
    ("data.demos.reflections", "true"),
])
def test_a_replaced_key_is_refused_with_the_new_one(capsys, old, value):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(BASE_RECIPE), f"--{old}", value])
    err = capsys.readouterr().err
    replaced = next(key for key in REPLACED_KEYS if old == key or old.startswith(key + "."))
    assert stop.value.code == 2
    assert f"{replaced} was replaced by {REPLACED_KEYS[replaced]}" in err


def test_a_replaced_key_in_a_config_file_is_refused_with_the_new_one(tmp_path, capsys):
    config = tmp_path / "old.yaml"
    config.write_text("model:\n  phases:\n    sft_warmup_steps: 3\n")
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(BASE_RECIPE), "--config", str(config)])
    assert stop.value.code == 2
    assert "model.phases.sft_warmup_steps was replaced by model.phases.warmstart.steps" in capsys.readouterr().err


def test_the_distillation_is_a_phase_that_at_names_and_rl_shares_its_learning_rate_schedule_with():
    from r3lightning.training.optim import OptimConfig, scheduled_learning_rate
    from r3lightning.training.phases import DistillPhase

    schedule = PhaseSchedule(WarmStartPhase(steps=2), distill=DistillPhase(enabled=True, start=4, beta=0.1, teacher="anchor"))
    assert [schedule.at(s).name for s in range(6)] == ["warmstart"] * 2 + ["rl"] * 2 + ["distill"] * 2
    warm, rl, distill = schedule.phases()
    assert (rl.start, rl.end, distill.start, distill.end) == (2, 4, 4, None)
    assert (distill.samples, distill.teacher, distill.is_rl, distill.validate) == ("teacher_scored_rollouts", "anchor", True, True)
    assert [schedule.distill_begins(s) for s in (3, 4, 5)] == [False, True, False]
    assert schedule.before(4).name == "rl" and schedule.before(5).name == "distill"
    # The distillation goes on with RL's optimizer: one warm-up from the warm-start's end, no second one.
    optim = OptimConfig(lr=1.0, warmup_steps=3, lr_decay="cosine")
    without = PhaseSchedule(WarmStartPhase(steps=2))
    assert [scheduled_learning_rate(s, optim, schedule.at(s), 10) for s in range(10)] == \
           [scheduled_learning_rate(s, optim, without.at(s), 10) for s in range(10)]
    # From the warm-start's end (start null) the RL phase is left out; beta 0 has no teacher.
    schedule = PhaseSchedule(WarmStartPhase(steps=2), distill=DistillPhase(enabled=True, beta=0.0))
    assert [p.name for p in schedule.phases()] == ["warmstart", "distill"]
    assert (schedule.distill_start, schedule.at(2).teacher, schedule.at(2).samples) == (2, None, "rollouts")
    # Off by default, and never before the warm-start's end.
    assert PhaseSchedule().distill_start is None and [p.name for p in PhaseSchedule().phases()] == ["rl"]
    with pytest.raises(ValueError, match=r"model.phases.distill.start \(1\) comes before the end of the reflective SFT"):
        PhaseSchedule(WarmStartPhase(steps=2), distill=DistillPhase(enabled=True, start=1)).check(max_steps=10)


def test_the_old_distillation_callback_is_refused_with_the_phase_keys(tmp_path, capsys):
    config = tmp_path / "old.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: r3lightning.callbacks.ReflectiveToDirectDistillation\n"
                      "      init_args: {beta: 0.05}\n")
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(BASE_RECIPE), "--config", str(config)])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert f"config file {str(config)!r}, line 3: r3lightning.callbacks.ReflectiveToDirectDistillation was replaced by " \
           "the phase model.phases.distill (enabled: true;" in err
    assert "model.phases.distill.beta" in err and "switch_step is model.phases.distill.start" in err


def test_a_schedule_saved_before_the_distillation_phase_existed_loads_without_one():
    """Checkpoints keep the schedule among the module's hyper-parameters; one pickled without ``distill``
    (written before the phase existed) gets the default, off."""
    import io

    import torch

    import r3lightning.module  # noqa: F401 (allows the config classes in torch's safe loader)

    old = PhaseSchedule(WarmStartPhase(steps=2))
    del old.__dict__["distill"]
    buffer = io.BytesIO()
    torch.save({"phases": old}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["phases"]
    assert not loaded.distill.enabled and [p.name for p in loaded.phases()] == ["warmstart", "rl"]
