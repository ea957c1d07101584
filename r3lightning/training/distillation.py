"""ReflectRL's distillation phase (``model.phases.distill``, docs/reflectrl.md): its first step, its
validations and its state.

The module drives it: at the phase's first step, before the step rolls anything out, ``begin``
measures the teacher's premise (``check_teacher_premise``), copies the policy into a frozen teacher
(no gradients, eval mode, not a submodule) and calls ``module.set_teacher``; with ``seed_literal`` the
student restarts from its first weights. The data side needs nothing at that moment: the datamodule
was told the phase's first step when it was connected (a task's view is a pure function of its
index), and validation asks for the direct view once the phase has begun (``validation_view``).

Its state (whether the phase began and where, the teacher's weights or the file holding them, the
student's first weights for ``seed_literal``, the premise's figures, the validation records) is
saved in the module's checkpoint section ``r3lightning.distill``; a checkpoint written by the old
``ReflectiveToDirectDistillation`` callback keeps the same state under ``callbacks`` and is loaded
from there. A run resumed in the phase keeps the checkpoint's beta, estimator and teacher mode (warned
when the config says otherwise); one resumed before it takes the configured ones. A checkpoint made
for another first step is refused (the task stream would not match).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from r3lightning.algos.premise import context_gain, paired_success_sums
from r3lightning.data.state_checks import expect_int, expect_number, expect_type
from r3lightning.training.log_dir import log_dir_of
from r3lightning.training.phases import DistillPhase

REFLECTIVE, DISTILL = "reflective", "distill"
"""The state's ``phase``: before the distillation began, and after."""
OLD_CALLBACK_STATE = "ReflectiveToDirectDistillation"
"""The ``checkpoint["callbacks"]`` key under which the old callback kept the same state."""
PREMISE_HOOK = "on_teacher_premise_failed"
"""Callbacks with a method of this name, ``(trainer, module, finding: str)``, are told when a
context-distillation teacher is no better with a golden negative in context (``ComponentHealth``
stops a strict run there) before the phase trains."""


class Distillation:
    """The distillation phase's state and what happens at its boundaries (its config: the module's
    ``phases.distill``). Its methods take the ``R3LightningModule`` that drives it (``module``)."""

    def __init__(self) -> None:
        self.switched_at: Optional[int] = None
        self.teacher_path: Optional[str] = None
        self.premise: Optional[dict[str, float]] = None
        self.records: list[dict[str, Any]] = []
        self.student_start: Optional[dict[str, torch.Tensor]] = None
        self.pending_teacher: Optional[dict[str, torch.Tensor]] = None

    @property
    def begun(self) -> bool:
        """Whether the phase has begun (its teacher taken, its data direct)."""
        return self.switched_at is not None

    # ---- setup --------------------------------------------------------------------------------
    @staticmethod
    def check(config: DistillPhase, pretrained: bool) -> None:
        """Refuse ``seed_literal`` for a policy built at random (there is no M_S to restart from)."""
        if config.enabled and config.teacher == "seed_literal" and not pretrained:
            raise ValueError(
                "model.phases.distill.teacher 'seed_literal' restarts the student from the pretrained model M_S, but "
                "model.model builds a tiny policy at random (no name_or_path or gguf_file): there is no M_S to restart "
                "from; load a pretrained policy or use teacher context_distillation/anchor"
            )

    def on_train_start(self, module: L.LightningModule) -> None:
        """Keep the student's first weights (``seed_literal``, a fresh run) and install a teacher restored
        from a checkpoint."""
        config = module.phases.distill
        if config.teacher == "seed_literal" and not self.begun and self.student_start is None and module.global_step == 0:
            self.student_start = {k: v.detach().cpu().clone() for k, v in module.policy.state_dict().items()}
        if self.pending_teacher is not None:
            self.install_teacher(module, self.pending_teacher)
            self.pending_teacher = None

    # ---- the phase's first step ---------------------------------------------------------------
    def begin(self, module: L.LightningModule) -> None:
        """The distillation's first step, before it rolls out: the premise gate, the frozen teacher
        (beta > 0), ``seed_literal``'s restart, the teacher's file (``teacher_storage: file``)."""
        trainer, config = module.trainer, module.phases.distill
        step = module.global_step
        first = module.phases.distill_start
        if first is not None and step > first:
            rank_zero_warn(
                f"model.phases.distill: the distillation begins at step {step}, after its first step {first} (a run "
                "resumed from a checkpoint without the distillation's state?)"
            )
        self.switched_at = step
        if config.beta > 0:
            if config.check_teacher_premise:
                self.check_premise(module)
            self.install_teacher(module, None)
            if config.teacher == "seed_literal":
                self.restart_student(module)
            if config.teacher_storage == "file":
                self.teacher_path = os.path.join(log_dir_of(trainer), f"teacher_step{step}.pt")
                if trainer.is_global_zero:
                    os.makedirs(os.path.dirname(self.teacher_path), exist_ok=True)
                    torch.save(module.teacher.state_dict(), self.teacher_path)
        rank_zero_info(
            f"[r3lightning] ReflectRL: distillation from step {step}: direct prompts"
            + (f", teacher KL beta={config.beta} ({config.estimator}, {config.teacher})" if config.beta > 0 else ", no teacher (beta 0)")
        )

    def check_premise(self, module: L.LightningModule) -> None:
        """The premise gate (``check_teacher_premise``), run with the policy about to become the teacher:
        greedy success on the validation questions with a golden negative, shown it and not."""
        trainer = module.trainer
        dm = module.datamodule
        tasks = dm.validation_tasks(with_golden_negative=True)
        training = module.policy.training
        module.policy.eval()
        try:
            with_gnt = dm.evaluate(tasks, greedy=True, direct=False)
            direct = dm.evaluate(tasks, greedy=True, direct=True)
        finally:
            module.policy.train(training)
        sums = paired_success_sums(torch.tensor([float(t.success) for t in with_gnt], dtype=torch.float64),
                                   torch.tensor([float(t.success) for t in direct], dtype=torch.float64))
        if trainer.world_size > 1:
            sums = trainer.strategy.reduce(sums.to(module.device), reduce_op="sum").cpu()
        figures = context_gain(sums)
        self.premise = {"step": trainer.global_step, **figures}
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics({
                "distill/premise_success_with_gnt": figures["with"], "distill/premise_success_direct": figures["without"],
                "distill/premise_gain": figures["gain"], "distill/premise_gain_se": figures["gain_se"],
                "distill/premise_questions": figures["questions"],
            }, step=trainer.global_step)
        line = (
            f"[r3lightning] ReflectRL premise: the teacher (stage-1 policy) answers {100 * figures['with']:.1f}% of "
            f"{int(figures['questions'])} validation questions with a golden negative in its prompt and "
            f"{100 * figures['without']:.1f}% without (gain {100 * figures['gain']:+.1f} ± {100 * figures['gain_se']:.1f} points, "
            "standard error, greedy)"
        )
        if figures["questions"] == 0:
            rank_zero_warn("[r3lightning] ReflectRL premise: not measured, no validation question has a golden negative "
                           "(r3l gnt-pool --val_samples)")
            return
        if module.phases.distill.teacher != "context_distillation" or figures["gain"] > 0:
            rank_zero_info(line)
            return
        line += ": not better, so the context-distillation teacher has no reflective skill to transfer"
        for callback in trainer.callbacks:
            told = getattr(callback, PREMISE_HOOK, None)
            if callable(told):
                told(trainer, module, line)
        rank_zero_warn(line)

    def install_teacher(self, module: L.LightningModule, weights: Optional[dict]) -> None:
        """Teacher = a frozen copy of the policy (with ``weights`` loaded when given) set on the module."""
        config = module.phases.distill
        if isinstance(module.trainer.strategy, FSDPStrategy):
            raise ValueError(
                "model.phases.distill: the teacher cannot be copied from an FSDP-sharded policy; use DDP or one device"
            )
        teacher = copy.deepcopy(module.policy)
        if weights is not None:
            teacher.load_state_dict(weights)
        for param in teacher.parameters():
            param.grad = None
        contexts = module.datamodule.teacher_contexts() if config.teacher == "context_distillation" else None
        module.set_teacher(teacher, config.beta, config.estimator, contexts)

    def restart_student(self, module: L.LightningModule) -> None:
        """The seed's pipeline: the student is M_S again (its weights when training began), a fresh
        optimizer state, and the reflective policy is only its teacher."""
        if self.student_start is None:
            raise ValueError(
                "model.phases.distill.teacher 'seed_literal': no weights of the student from the start of training "
                "(the run resumed from a checkpoint made without teacher 'seed_literal')"
            )
        module.policy.load_state_dict(self.student_start)
        for optimizer in module.trainer.optimizers:
            optimizer.state.clear()
        self.student_start = None

    def step_metrics(self, module: L.LightningModule) -> dict[str, float]:
        """Logged every step: ``distill/phase``, ``distill/beta`` and, with a teacher,
        ``distill/teacher_param_distance`` (after the step's update)."""
        metrics = {"distill/phase": 1.0 if self.begun else 0.0,
                   "distill/beta": float(module.phases.distill.beta if self.begun else 0.0)}
        if module.teacher is not None:
            metrics["distill/teacher_param_distance"] = parameter_distance(module.policy, module.teacher)
        return metrics

    # ---- validation ---------------------------------------------------------------------------
    def at_switch_validation(self, module: L.LightningModule) -> bool:
        """Whether this validation is the last of stage 1, run at the distillation's first step."""
        trainer = module.trainer
        return (
            not self.begun
            and trainer.state.fn == "fit"
            and not trainer.sanity_checking
            and module.phases.distill_begins(trainer.global_step)
            and not module.skips_validation
        )

    def validate_direct(self, module: L.LightningModule) -> None:
        """At the switch validation (``evaluate_direct_at_switch``), the validation questions directly too:
        ``val_direct/success_rate_greedy``, ``val_direct/success_rate``, ``val_direct/response_len``."""
        if not (module.phases.distill.evaluate_direct_at_switch and self.at_switch_validation(module)):
            return
        dm = module.datamodule
        tasks = dm.validation_tasks()
        greedy = dm.evaluate(tasks, greedy=True, direct=True)
        sampled = dm.evaluate(tasks, greedy=False, direct=True)
        n = max(len(tasks), 1)
        figures = {
            "val_direct/success_rate_greedy": sum(t.success for t in greedy) / n,
            "val_direct/success_rate": sum(t.success for t in sampled) / n,
            "val_direct/response_len": sum(t.num_response_tokens for t in greedy) / n,
        }
        for name, value in figures.items():
            module.log(name, value, sync_dist=True, batch_size=1)

    def record_validation(self, module: L.LightningModule) -> None:
        """Keep a finished validation of ``fit`` (its ``val/`` figures, and ``val_direct/`` at the switch)
        for the report."""
        trainer = module.trainer
        if trainer.sanity_checking or trainer.state.fn != "fit" or module.skips_validation:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "val_direct/"))}
        if not self.at_switch_validation(module):
            metrics = {k: v for k, v in metrics.items() if not k.startswith("val_direct/")}
        stage = 2 if self.begun else 1
        self.records.append({"step": trainer.global_step, "stage": stage, "mode": "direct" if self.begun else "reflective", **metrics})

    def report(self, module: L.LightningModule) -> None:
        """At the end of fit: print validation success at the end of each stage and write the records to
        ``<log_dir>/reflectrl_report.json``."""
        trainer = module.trainer
        if not trainer.is_global_zero or not self.records:
            return
        stage1 = [r for r in self.records if r["stage"] == 1]
        stage2 = [r for r in self.records if r["stage"] == 2]
        lines = ["[r3lightning] ReflectRL validation success (greedy / sampled):"]

        def line(label: str, record: dict, prefix: str = "val/") -> str:
            return (
                f"  {label:<40} step {record['step']:>5}: {100 * record.get(prefix + 'success_rate_greedy', float('nan')):5.1f}% / "
                f"{100 * record.get(prefix + 'success_rate', float('nan')):5.1f}%"
            )

        if stage1:
            lines.append(line("stage 1 end (reflective, GNT in context)", stage1[-1]))
            if "val_direct/success_rate_greedy" in stage1[-1]:
                lines.append(line("stage 1 end (direct, no GNT)", stage1[-1], "val_direct/"))
        if stage2:
            lines.append(line("stage 2 end (direct, no GNT)", stage2[-1]))
        print("\n".join(lines), flush=True)
        config = module.phases.distill
        log_dir = log_dir_of(trainer)
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, "reflectrl_report.json"), "w") as handle:
            json.dump({"switch_step": module.phases.distill_start, "switched_at": self.switched_at, "beta": config.beta,
                       "estimator": config.estimator, "teacher": config.teacher, "premise": self.premise,
                       "records": self.records}, handle, indent=2)

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self, module: L.LightningModule) -> dict[str, Any]:
        """The state a checkpoint keeps (``r3lightning.distill``)."""
        config = module.phases.distill
        weights = None
        if config.teacher_storage == "checkpoint":
            if module.teacher is not None:
                weights = {k: v.detach().cpu().clone() for k, v in module.teacher.state_dict().items()}
            elif self.pending_teacher is not None:
                weights = self.pending_teacher
        return {
            "phase": DISTILL if self.begun else REFLECTIVE,
            "beta": config.beta,
            "estimator": config.estimator,
            "teacher_mode": config.teacher,
            "switch_step": module.phases.distill_start,
            "switched_at": self.switched_at,
            "teacher": weights,
            "teacher_path": self.teacher_path,
            "student_start": self.student_start,
            "records": self.records,
            "premise": self.premise,
        }

    @staticmethod
    def check_state_dict(state: Any) -> None:
        """``ValueError("<field>: <problem>")`` for a damaged state (checked before any is restored)."""
        expect_type(state, dict, "state")
        for key in ("phase", "beta", "estimator"):
            if key not in state:
                raise ValueError(f"{key}: missing")
        if state["phase"] not in (REFLECTIVE, DISTILL):
            raise ValueError(f"phase: {state['phase']!r} is not {REFLECTIVE!r} or {DISTILL!r}")
        expect_number(state["beta"], "beta")
        expect_type(state["estimator"], str, "estimator")
        expect_int(state.get("switch_step"), "switch_step", none=True)
        expect_int(state.get("switched_at"), "switched_at", none=True)
        expect_type(state.get("teacher_path"), (str, type(None)), "teacher_path")
        expect_type(state.get("records", []), list, "records")
        expect_type(state.get("premise"), (dict, type(None)), "premise")
        teacher = state.get("teacher")
        expect_type(teacher, (dict, type(None)), "teacher")
        for name, tensor in (teacher or {}).items():
            expect_type(tensor, torch.Tensor, f"teacher[{name!r}]")

    def load_state_dict(self, state: dict[str, Any], config: DistillPhase, first_step: Optional[int]) -> DistillPhase:
        """Restore ``state`` for a run configured with ``config`` whose distillation begins at ``first_step``;
        returns the config to go on with (a run resumed in the phase keeps the checkpoint's beta,
        estimator and teacher mode)."""
        begun = state["phase"] == DISTILL
        saved_first = state.get("switch_step")
        if saved_first is not None and first_step is not None and saved_first != first_step:
            raise ValueError(
                f"model.phases.distill: the checkpoint was made for a switch at step {saved_first}, this run switches at "
                f"{first_step}; the task stream would not match"
            )
        self.switched_at = state.get("switched_at") if begun else None
        if begun and self.switched_at is None:
            self.switched_at = saved_first if saved_first is not None else first_step
        self.teacher_path = state.get("teacher_path")
        self.records = list(state.get("records", []))
        self.premise = state.get("premise")
        if config.teacher == "seed_literal" and not begun and state.get("student_start") is not None:
            self.student_start = state["student_start"]
        if begun:
            # Before the switch nothing has used them yet: the configured values apply (a stage-1 checkpoint
            # can start stage-2 runs with several betas). After it, the run goes on as it was. Checkpoints
            # made before the ``teacher`` knob had the anchor teacher.
            saved = {"beta": state["beta"], "estimator": state["estimator"], "teacher": state.get("teacher_mode", "anchor")}
            changed = {name: value for name, value in saved.items() if value != getattr(config, name)}
            for name, value in changed.items():
                rank_zero_warn(
                    f"model.phases.distill: resuming in the distillation phase with the checkpoint's {name}={value!r}, not "
                    f"the configured {getattr(config, name)!r}"
                )
            config = dataclasses.replace(config, **changed)
        if begun and config.beta > 0:
            weights = state.get("teacher")
            if weights is None:
                if not self.teacher_path or not os.path.isfile(self.teacher_path):
                    raise ValueError(
                        "model.phases.distill: the checkpoint is in the distillation phase but holds no teacher weights and "
                        f"its teacher file {self.teacher_path!r} does not exist"
                    )
                weights = torch.load(self.teacher_path, map_location="cpu", weights_only=True)
            self.pending_teacher = weights
        return config


def saved_state(checkpoint: dict[str, Any], take: bool = False) -> tuple[Optional[Any], str]:
    """The distillation state a checkpoint holds and where: its ``r3lightning.distill`` section, or the old
    callback's (``callbacks["ReflectiveToDirectDistillation"]``); ``(None, "")`` without one. ``take``
    removes the old callback's entry, so that Lightning does not ask for a callback that no longer exists."""
    section = checkpoint.get("r3lightning")
    if isinstance(section, dict) and section.get("distill") is not None:
        return section["distill"], "r3lightning.distill"
    callbacks = checkpoint.get("callbacks")
    if isinstance(callbacks, dict) and OLD_CALLBACK_STATE in callbacks:
        state = callbacks.pop(OLD_CALLBACK_STATE) if take else callbacks[OLD_CALLBACK_STATE]
        return state, f"callbacks[{OLD_CALLBACK_STATE!r}]"
    return None, ""


def parameter_distance(student: torch.nn.Module, teacher: torch.nn.Module) -> float:
    """‖θ_student − θ_teacher‖₂ / ‖θ_teacher‖₂ over all parameters (0.0 when they are the same weights)."""
    with torch.no_grad():
        diff = sum(float((s.float() - t.float()).pow(2).sum()) for s, t in zip(student.parameters(), teacher.parameters()))
        norm = sum(float(t.float().pow(2).sum()) for t in teacher.parameters())
    return (diff / max(norm, 1e-30)) ** 0.5
