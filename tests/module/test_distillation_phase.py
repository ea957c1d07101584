"""ReflectRL's distillation phase (``model.phases.distill``): the switch happens once, at the phase's
first step; the teacher is a frozen copy that never changes while the student trains; by default it scores the student's direct
answers with the question's GNT in its context, so its KL is not zero at the switch (the anchor
teacher's is, while student == teacher; the seed-literal student starts from M_S, not the teacher);
the data and the validation turn direct; and a run resumed in stage 2 gets the same teacher and phase.

The suite is ``DigitSuite`` (any digit is right) wrapped in a ``ReflectiveSuite``, so a random tiny
policy gets mixed rewards and the student moves away from its teacher in a few steps.
"""

import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from digit_suite import DigitSuite
from harness import module_and_data, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.callbacks import ComponentHealth, InertComponentError
from r3lightning.data.demonstrations import DemoConfig
from r3lightning.data.reflectrl.gnt_pool import PoolStats, build_pool, write_jsonl
from r3lightning.data.reflectrl.reflective_sft import build_sft_rows, scripted_critiques, suite_verifier, training_gnt_rows
from r3lightning.envs.reflective import ReflectiveSuite
from r3lightning.training.models import ModelConfig
from r3lightning.training.phases import DistillPhase
from scripted_engine import UseEngine


def digit_rows(suite):
    rows = []
    for split, tasks in (("train", [suite.train_task(i) for i in range(6)]), ("val", suite.val_tasks())):
        for index, task in enumerate(tasks):
            for sample, response in enumerate((task.answer, "none")):
                rows.append({"task_id": task.task_id, "split": split, "index": index, "question": task.prompt,
                             "prompt": task.prompt, "answer": task.answer, "response": response, "expert": "x",
                             "engine": "none", "sampling": {}, "sample": sample, "source": "generated"})
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("reflectrl")
    suite = DigitSuite()
    pool, _ = build_pool(digit_rows(suite), suite, PoolStats())
    write_jsonl(str(root / "pool.jsonl"), pool)
    critiques = scripted_critiques(training_gnt_rows(pool), lambda task, response: f"{response} has no digit. {task.answer}")
    rows, _ = build_sft_rows(pool, critiques, suite_verifier(suite), suite.system_prompt)
    write_jsonl(str(root / "sft.jsonl"), rows)
    return SimpleNamespace(root=root, pool=str(root / "pool.jsonl"), sft=str(root / "sft.jsonl"))


def make(files, sft_steps=2, algorithm=None, seed=3, direct_tasks="pool", **distill):
    """A module and datamodule whose schedule ends with the distillation phase ``DistillPhase(**distill)``."""
    module, dm = module_and_data(
        ReflectiveSuite(DigitSuite(), files.pool, direct_tasks=direct_tasks), sft_steps=sft_steps, lr=1e-2, seed=seed,
        algorithm=algorithm or AlgorithmConfig(policy_loss="ppo_clip"),
    )
    module.phases.warmstart.demos = DemoConfig(source=files.sft, tasks_per_step=4)
    module.phases.distill = DistillPhase(enabled=True, **distill)
    return module, dm


@pytest.fixture(scope="module")
def pretrained(files, tmp_path_factory):
    """A Hugging Face model directory holding a tiny policy after one SFT step: loaded from it, the
    policy counts as pretrained (``ModelConfig.pretrained``), which ``seed_literal`` needs."""
    module, dm = make(files, sft_steps=2, beta=0.0)
    fit(module, dm, 1, [])
    directory = tmp_path_factory.mktemp("pretrained")
    module.policy.save_pretrained(directory)
    module.tokenizer.save_pretrained(directory)
    return str(directory)


def make_pretrained(files, directory, **kwargs):
    """``make``, with the policy loaded from the model directory ``directory``."""
    module, dm = make(files, **kwargs)
    module.model_config = ModelConfig(name_or_path=directory)
    return module, dm


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Probe(L.Callback):
    """Per step: whether the batch's tasks are reflective, the logged distill/* figures, the teacher and
    the policy at the first step that has one."""

    def __init__(self):
        self.steps, self.teachers, self.validations = {}, {}, []
        self.set_teacher_calls = []

    def on_fit_start(self, trainer, module):
        original = module.set_teacher

        def counted(teacher, *args, **kwargs):
            self.set_teacher_calls.append((trainer.global_step, teacher is not None))
            return original(teacher, *args, **kwargs)

        module.set_teacher = counted

    def on_train_start(self, trainer, module):
        self.start = weights(module.policy)

    def on_before_backward(self, trainer, module, loss):
        # The step's first backward: the teacher (taken at the top of the phase's first step) and the
        # policy that rolled the step out.
        if module.teacher is not None:
            self.teachers.setdefault(id(module.teacher), (trainer.global_step, weights(module.teacher), weights(module.policy)))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.steps[trainer.global_step - 1] = {
            "reflective": [bool(t.data.get("reflective")) for t in batch.tasks],
            "phase": float(metrics["distill/phase"]),
            "kl": float(metrics["distill/kl_teacher"]) if "distill/kl_teacher" in metrics and module.phase.is_rl else None,
            "has_teacher_loss": "train/loss_teacher_kl" in metrics,
            "context_rate": float(metrics["distill/teacher_context_rate"]) if "distill/teacher_context_rate" in metrics and module.phase.is_rl else None,
            "distance": float(metrics["distill/teacher_param_distance"]) if "distill/teacher_param_distance" in metrics else None,
        }

    def on_validation_start(self, trainer, module):
        self.validations.append((trainer.global_step, not module.validation_view))  # whether the GNT is shown


def fit(module, dm, steps, callbacks, ckpt_path=None, **trainer_args):
    trainer = quiet_trainer(steps, deterministic=True, callbacks=callbacks, **trainer_args)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_switches_once_at_the_step_and_the_teacher_stays_frozen(files):
    module, dm = make(files, sft_steps=2, beta=0.5, teacher="anchor")
    probe = Probe()
    fit(module, dm, 5, [probe])
    # Exactly one teacher, set before step 2 ran (the first stage-2 step).
    assert probe.set_teacher_calls == [(2, True)]
    assert [probe.steps[s]["phase"] for s in range(5)] == [0.0, 0.0, 1.0, 1.0, 1.0]
    # The data: reflective tasks in stage 1 (the SFT head trains from the file), direct from the switch on.
    assert all(all(probe.steps[s]["reflective"]) for s in (0, 1))
    assert not any(any(probe.steps[s]["reflective"]) for s in (2, 3, 4))
    assert dm.suite.direct_from_index == 2 * 1 * dm.tasks_per_step
    # The teacher: the policy as stage 2 began, no gradients, unchanged while the student trained.
    [(step, at_switch, policy_at_switch)] = probe.teachers.values()
    assert step == 2
    for name, value in weights(module.teacher).items():
        assert torch.equal(value, at_switch[name]) and torch.equal(value, policy_at_switch[name]), name
    assert all(not p.requires_grad and p.grad is None for p in module.teacher.parameters())
    assert not module.teacher.training
    assert any(not torch.equal(v, at_switch[k]) for k, v in weights(module.policy).items())  # the student moved
    assert all(m is not module.teacher for m in module.modules())  # not a submodule: not in the state dict
    # KL(student || teacher) is zero while they are equal (the first stage-2 step), then positive.
    assert probe.steps[2]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert probe.steps[4]["kl"] > 1e-6
    assert probe.steps[4]["has_teacher_loss"]


@pytest.mark.parametrize(
    "advantage, policy_loss, estimator",
    [("grpo", "ppo_clip", "exact"), ("rloo", "pg", "exact"), ("reinforce", "pg", "sampled"), ("grpo", "pg", "sampled")],
)
def test_the_teacher_kl_joins_any_objective(files, advantage, policy_loss, estimator):
    module, dm = make(files, sft_steps=1, algorithm=AlgorithmConfig(advantage=advantage, policy_loss=policy_loss),
                      beta=0.5, estimator=estimator, teacher="anchor")
    probe = Probe()
    fit(module, dm, 3, [probe])
    assert module.teacher_kl_estimator == estimator and module.teacher_kl_coef == 0.5
    assert probe.steps[1]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert probe.steps[2]["kl"] > 0 and probe.steps[2]["has_teacher_loss"]


def test_the_default_teacher_sees_the_gnt_so_its_kl_is_not_zero_at_the_switch(files):
    """Context distillation: at the first stage-2 step the student's weights are the teacher's, yet the
    teacher scores the answers with the question's GNT in its context, so there is something to distill.
    (The anchor teacher of the old code scored them in the student's context: exactly zero here.)"""
    module, dm = make(files, sft_steps=2, direct_tasks="suite", beta=0.5)  # questions without a GNT too
    probe = Probe()
    assert module.phases.distill.teacher == "context_distillation"
    fit(module, dm, 4, [probe])
    assert probe.set_teacher_calls == [(2, True)]
    [(step, teacher_at_switch, policy_at_switch)] = probe.teachers.values()
    assert all(torch.equal(v, policy_at_switch[k]) for k, v in teacher_at_switch.items())  # the same weights ...
    assert probe.steps[2]["kl"] > 1e-4  # ... and still a KL to distill
    assert probe.steps[2]["distance"] > 0.0  # logged after the update: the student has moved
    # DigitSuite has 7 questions; the pool's GNTs cover 6 of them (training tasks 0-5): the 7th is
    # scored under its own prompt.
    contexts = module.teacher_contexts
    assert len(contexts) == 6
    assert all(0.0 < probe.steps[s]["context_rate"] <= 1.0 for s in (2, 3))
    suite = dm.suite
    asked = {dm.suite.suite.train_task(i).prompt for i in range(2 * dm.tasks_per_step, 4 * dm.tasks_per_step)}
    with_gnt = set(suite.teacher_prompts())
    expected = sum(1 for i in range(2 * dm.tasks_per_step, 3 * dm.tasks_per_step) if suite.suite.train_task(i).prompt in with_gnt)
    assert probe.steps[2]["context_rate"] == pytest.approx(expected / dm.tasks_per_step)
    assert asked - with_gnt == {"Say a number above 6."}
    # Stage-2 questions from the pool (the default): every one has a GNT.
    module, dm = make(files, sft_steps=1, beta=0.5)
    probe = Probe()
    fit(module, dm, 2, [probe])
    assert probe.steps[1]["context_rate"] == 1.0 and probe.steps[1]["kl"] > 1e-4


def test_seed_literal_is_refused_for_a_policy_built_at_random(files):
    """M_S is the pretrained student; a tiny policy built at random has none to restart from."""
    module, dm = make(files, sft_steps=1, beta=0.5, teacher="seed_literal")
    with pytest.raises(ValueError, match="seed_literal.*no M_S to restart from"):
        fit(module, dm, 2, [])


def test_seed_literal_restarts_the_student_from_its_first_weights(files, pretrained):
    module, dm = make_pretrained(files, pretrained, sft_steps=2, beta=0.5, teacher="seed_literal")
    probe = Probe()
    fit(module, dm, 4, [probe])
    [(step, teacher_at_switch, policy_at_switch)] = probe.teachers.values()
    assert step == 2
    # At the switch the student is M_S again (not the teacher), and the teacher is the stage-1 policy.
    assert probe.steps[2]["kl"] > 1e-4
    assert any(not torch.equal(policy_at_switch[k], v) for k, v in teacher_at_switch.items())
    assert module.teacher_contexts is None  # the teacher scores in the direct context
    for name, value in policy_at_switch.items():
        assert torch.equal(value, probe.start[name]), name


def test_beta_zero_switches_the_data_without_a_teacher(files):
    module, dm = make(files, sft_steps=1, beta=0.0)
    probe = Probe()
    fit(module, dm, 2, [probe])
    assert module.teacher is None and probe.set_teacher_calls == []
    assert probe.steps[1]["phase"] == 1.0 and not any(probe.steps[1]["reflective"])
    assert not probe.steps[1]["has_teacher_loss"]


def test_later_switch_step_and_validation_modes(files, tmp_path):
    """Stage 1 may go on with RL on reflective tasks; validation is reflective up to the switch (where the
    direct questions are validated too) and direct after it."""
    module, dm = make(files, sft_steps=1, beta=0.5, start=2)
    probe = Probe()
    fit(module, dm, 4, [probe], limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None,
        default_root_dir=str(tmp_path))  # the phase's report goes there, not into the working directory
    assert probe.set_teacher_calls == [(2, True)]
    assert all(probe.steps[1]["reflective"]) and module.phase.is_rl  # step 1 was a reflective RL step
    assert not any(probe.steps[2]["reflective"])
    assert probe.validations == [(2, True), (4, False)]
    first, last = module.distillation.records
    assert (first["stage"], first["mode"], last["stage"], last["mode"]) == (1, "reflective", 2, "direct")
    assert {"val/success_rate_greedy", "val_direct/success_rate_greedy", "val_direct/response_len"} <= set(first)
    assert "val_direct/success_rate_greedy" not in last


@pytest.mark.parametrize("storage", ["checkpoint", "file"])
def test_resume_in_stage_two_restores_teacher_and_phase(files, tmp_path, storage):
    N = 2

    L.seed_everything(0)
    module, dm = make(files, sft_steps=1, beta=0.5, teacher_storage=storage)
    saver = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=N, save_top_k=-1)
    fit(module, dm, 2 * N, [saver], enable_checkpointing=True, default_root_dir=str(tmp_path))
    checkpoint = str(tmp_path / f"step={N}.ckpt")
    saved = torch.load(checkpoint, weights_only=True)["r3lightning"]["distill"]
    assert (saved["phase"], saved["switched_at"], saved["beta"]) == ("distill", 1, 0.5)
    assert (saved["teacher"] is not None) == (storage == "checkpoint")

    L.seed_everything(1234)  # a fresh process starts from another global RNG state
    resumed_module, resumed_dm = make(files, sft_steps=1, beta=0.5, teacher_storage=storage)
    fit(resumed_module, resumed_dm, 2 * N, [], ckpt_path=checkpoint, default_root_dir=str(tmp_path))
    resumed = resumed_module.distillation
    assert (resumed.begun, resumed.switched_at) == (True, 1)
    assert resumed_module.teacher is not None and resumed_module.teacher_kl_coef == 0.5
    assert all(not p.requires_grad for p in resumed_module.teacher.parameters())
    for name, value in weights(module.teacher).items():
        assert torch.equal(weights(resumed_module.teacher)[name], value), name
    for name, value in weights(module.policy).items():
        torch.testing.assert_close(weights(resumed_module.policy)[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.equal(weights(module.policy)[k], v) for k, v in weights(module.teacher).items())


def test_bad_settings_fail_clearly(files):
    module, dm = make(files, sft_steps=2, start=1)
    with pytest.raises(ValueError, match="before the end of the reflective SFT"):
        fit(module, dm, 1, [])
    module, dm = module_and_data(DigitSuite())
    module.phases.distill = DistillPhase(enabled=True)
    with pytest.raises(ValueError, match="needs data.suite: r3lightning.envs.reflective.ReflectiveSuite"):
        fit(module, dm, 1, [])
    with pytest.raises(ValueError, match="beta"):
        DistillPhase(beta=-1.0)
    with pytest.raises(ValueError, match="estimator"):
        DistillPhase(estimator="k3")


def test_a_stage_one_checkpoint_starts_stage_two_with_the_configured_beta(files, tmp_path):
    module, dm = make(files, sft_steps=1, beta=0.5)
    trainer = fit(module, dm, 1, [], default_root_dir=str(tmp_path))
    checkpoint = str(tmp_path / "stage1.ckpt")
    trainer.save_checkpoint(checkpoint)
    resumed_module, resumed_dm = make(files, sft_steps=1, beta=0.2, estimator="sampled")
    fit(resumed_module, resumed_dm, 2, [], ckpt_path=checkpoint, default_root_dir=str(tmp_path))
    resumed = resumed_module.distillation
    assert (resumed_module.phases.distill.beta, resumed.begun, resumed.switched_at) == (0.2, True, 1)
    assert (resumed_module.teacher_kl_coef, resumed_module.teacher_kl_estimator) == (0.2, "sampled")
    with pytest.raises(ValueError, match="switch at step 1, this run switches at 2"):
        other_module, other_dm = make(files, sft_steps=1, start=2)
        fit(other_module, other_dm, 3, [], ckpt_path=checkpoint, default_root_dir=str(tmp_path))


def test_a_seed_literal_stage_one_without_teacher_starts_a_seed_literal_stage_two(files, pretrained, tmp_path):
    """experiments/compare_reflectrl.py's flow: stage 1 with teacher seed_literal and beta 0 (no teacher,
    nothing else changes) keeps the student's first weights in its checkpoint; an arm resumed from it
    with beta > 0 restarts the student from them at the switch, the stage-1 policy as its teacher."""
    module, dm = make_pretrained(files, pretrained, sft_steps=1, beta=0.0, teacher="seed_literal")
    probe = Probe()
    trainer = fit(module, dm, 1, [probe], default_root_dir=str(tmp_path))
    checkpoint = str(tmp_path / "stage1.ckpt")
    trainer.save_checkpoint(checkpoint)
    stage_one = weights(module.policy)
    assert any(not torch.equal(stage_one[k], v) for k, v in probe.start.items())
    resumed_module, resumed_dm = make_pretrained(files, pretrained, sft_steps=1, beta=0.5, teacher="seed_literal")
    resumed_probe = Probe()
    fit(resumed_module, resumed_dm, 2, [resumed_probe], ckpt_path=checkpoint, default_root_dir=str(tmp_path))
    [(step, teacher_at_switch, policy_at_switch)] = resumed_probe.teachers.values()
    assert step == 1
    for name, value in teacher_at_switch.items():
        assert torch.equal(value, stage_one[name]), name
    for name, value in policy_at_switch.items():
        assert torch.equal(value, probe.start[name]), name


# ---- the premise gate: is the teacher better with a golden negative in its prompt? ------------------
def gnt_hurts(suite):
    """A scripted policy that answers a digit (right, for DigitSuite) unless its prompt shows a GNT."""
    return lambda text: "none" if "A previous answer, which is wrong" in text else "7"


def gnt_helps(suite):
    return lambda text: "7" if "A previous answer, which is wrong" in text else "none"


def test_premise_gate_measures_the_teacher_with_and_without_the_gnt_and_strict_health_refuses_a_worse_one(files, tmp_path):
    module, dm = make(files, sft_steps=1, beta=0.5)
    with pytest.raises(InertComponentError, match="premise.*0.0% of 1 validation questions with a golden negative.*100.0% without.*not better"):
        fit(module, dm, 2, [UseEngine(gnt_hurts), ComponentHealth(strict=True, update_kl_max=None)], default_root_dir=str(tmp_path))
    assert module.teacher is None  # refused before stage 2 trained
    premise = module.distillation.premise
    assert premise["with"] == 0.0 and premise["without"] == 1.0 and premise["gain"] == -1.0
    # Without strict health the run goes on, warned, with the figures kept for the report.
    module, dm = make(files, sft_steps=1, beta=0.5)
    with pytest.warns(UserWarning, match="not better"):
        fit(module, dm, 2, [UseEngine(gnt_hurts), ComponentHealth(strict=False, update_kl_max=None)], default_root_dir=str(tmp_path))
    premise = module.distillation.premise
    assert module.teacher is not None and premise["questions"] == 1.0 and premise["step"] == 1
    assert module.distillation.state_dict(module)["premise"] == premise


def test_premise_gate_lets_a_better_teacher_through_under_strict_health(files, tmp_path):
    module, dm = make(files, sft_steps=1, beta=0.5)
    fit(module, dm, 2, [UseEngine(gnt_helps), ComponentHealth(strict=True, update_kl_max=None)], default_root_dir=str(tmp_path))
    assert module.teacher is not None
    premise = module.distillation.premise
    assert (premise["with"], premise["without"], premise["gain"]) == (1.0, 0.0, 1.0)


def test_a_checkpoint_of_the_old_callback_resumes_in_the_phase(files, tmp_path):
    """The ``ReflectiveToDirectDistillation`` callback this phase replaced kept the same state under
    ``callbacks``: such a checkpoint loads, with its teacher, and Lightning is not asked for the callback."""
    module, dm = make(files, sft_steps=1, beta=0.5)
    trainer = fit(module, dm, 2, [], default_root_dir=str(tmp_path))
    new_format = str(tmp_path / "stage2.ckpt")
    trainer.save_checkpoint(new_format)
    checkpoint = torch.load(new_format, weights_only=True)
    checkpoint.setdefault("callbacks", {})["ReflectiveToDirectDistillation"] = checkpoint["r3lightning"].pop("distill")
    old_format = str(tmp_path / "old.ckpt")
    torch.save(checkpoint, old_format)
    resumed_module, resumed_dm = make(files, sft_steps=1, beta=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(resumed_module, resumed_dm, 3, [], ckpt_path=old_format, default_root_dir=str(tmp_path))
    assert not [w for w in caught if "callbacks used to create the checkpoint" in str(w.message)]
    assert (resumed_module.distillation.begun, resumed_module.distillation.switched_at) == (True, 1)
    for name, value in weights(module.teacher).items():
        assert torch.equal(weights(resumed_module.teacher)[name], value), name
