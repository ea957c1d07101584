"""ReflectRL's reflective-to-direct distillation phase (docs/reflectrl.md).

Stage 1 trains a *reflective* policy: SFT on GT+ answers and on critiques of golden negatives (and,
optionally, RL on reflective tasks). At the switch step, this callback snapshots that policy as a
frozen teacher, the data turns to direct prompts (no GNT in context), and every RL step from then on
also pays ``beta · KL(π_student ‖ π_teacher)`` on the direct rollouts' response tokens, on top of
whichever RL objective is configured (``R3LightningModule.set_teacher``). By default the teacher scores
those tokens with a golden negative of the question in its context (context distillation), so what
the reflective policy does with a GNT is what the direct student is pulled toward.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Literal, Optional, get_args

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from r3lightning.algos.premise import context_gain, paired_success_sums
from r3lightning.callbacks.component_health import ComponentHealth, InertComponentError
from r3lightning.callbacks.monitor import log_dir_of
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.data.state_checks import expect_int, expect_number, expect_type

REFLECTIVE, DISTILL = "reflective", "distill"
TeacherMode = Literal["context_distillation", "seed_literal", "anchor"]


class ReflectiveToDirectDistillation(L.Callback):
    """Switches a ReflectRL run from its reflective stage to direct answering with a frozen teacher.

    Needs ``data.suite: r3lightning.envs.reflective.ReflectiveSuite``: when fit starts (after the model
    and its tokenizer are built, before the task stream starts) the callback sets the suite's
    ``direct_from_index`` so that every training batch from the switch step on holds direct tasks (a pure function of the task index: prefetching and exact resume stay
    correct), and before each validation it sets ``show_gnt_in_validation`` (reflective validation in
    stage 1, direct in stage 2).

    At the first training step with ``global_step >= switch_step`` (exactly once) it copies the policy
    into a frozen teacher (no gradients, eval mode, not a submodule) and calls
    ``module.set_teacher(teacher, beta, estimator, contexts)``. Logged every step: ``distill/phase`` (0 in
    the reflective stage, 1 in distillation), ``distill/beta``, and with a teacher
    ``distill/teacher_param_distance`` (‖θ_student − θ_teacher‖ / ‖θ_teacher‖: 0 while they are the same
    weights); the module logs ``distill/kl_teacher`` and ``distill/teacher_context_rate``. Its
    state (phase, beta, estimator, switch step, the teacher's weights or the file holding them, the
    validation records) is saved in checkpoints and restored on resume, the teacher rebuilt from the
    policy's structure with its saved weights; a run resumed in stage 2 keeps the checkpoint's beta and
    estimator, one resumed in stage 1 takes the configured ones. At the end of fit it prints validation success at the
    end of each stage and writes its records to ``<log_dir>/reflectrl_report.json``.

    Args:
        beta: weight of KL(π_student ‖ π_teacher) per RL token (token mean over the step's RL tokens).
            0 switches the data only, with no teacher (the "GT+ only" baseline of docs/reflectrl.md).
        estimator: ``exact`` (the KL over the whole vocabulary at each position, one extra teacher
            forward per micro-batch) or ``sampled`` (the k3 estimate from the sampled tokens'
            log-probs: cheaper to reduce, noisier).
        switch_step: global step at which stage 2 begins; null: when the warm-start
            (``model.phases.warmstart``, stage 1's reflective SFT) ends. It may not come before.
        evaluate_direct_at_switch: at a validation run at the switch step (the last of stage 1, which is
            reflective), also run the validation questions in direct mode, logged as
            ``val_direct/success_rate_greedy``, ``val_direct/success_rate`` and
            ``val_direct/response_len``. Make ``switch_step`` a multiple of ``trainer.val_check_interval``.
        teacher_storage: where the teacher's weights are saved: ``checkpoint`` (in this callback's
            state in every checkpoint) or ``file`` (once, to ``<log_dir>/teacher_step<S>.pt``; the
            checkpoints keep only its path, which must still exist on resume).
        teacher: what the teacher is and what it sees (docs/reflectrl.md, "The teacher").
            ``context_distillation`` (default, our reading of the paper): the reflective policy at the
            switch, scoring the student's direct response tokens under the *reflective* prompt of the same
            question (the question's first training GNT in context; a question without one is scored
            under its direct prompt, counted in ``distill/teacher_context_rate``); the student goes on
            from the same weights. ``seed_literal``: the teacher is the reflective policy M_S^refl
            scoring in the direct context, and the student restarts from the weights it had when
            training began (M_S; the optimizer state is reset), so student != teacher at the switch;
            its data are the student's own direct rollouts (the seed's M_S^refl rollouts are not
            implemented). ``anchor``: the teacher is the policy at the switch in the student's own
            direct context (the pre-2026-12 behaviour): a KL anchor, zero at the first stage-2 step.
            ``seed_literal`` needs a pretrained policy (``model.model.name_or_path`` or ``gguf_file``): a
            tiny policy built at random has no M_S to restart from, and is refused at setup.
        check_teacher_premise: when a teacher is installed (beta > 0), measure first whether it answers
            better with a golden negative in its prompt than without one (the premise of distilling it,
            docs/reflectrl.md, "The premise gate"): greedy success of the stage-1 policy on the
            validation questions that have a GNT, with it in the prompt and without, paired per
            question. Logged once at the switch as ``distill/premise_success_with_gnt``,
            ``distill/premise_success_direct``, ``distill/premise_gain`` (with − direct),
            ``distill/premise_gain_se`` and ``distill/premise_questions``, printed, and kept in the
            report and checkpoints. A ``context_distillation`` teacher that is not better (gain <= 0)
            is reported on the console, and under ``health.strict`` the run stops
            (``InertComponentError``) before stage 2 trains.
    """

    def __init__(
        self,
        beta: float = 0.05,
        estimator: Literal["exact", "sampled"] = "exact",
        switch_step: Optional[int] = None,
        evaluate_direct_at_switch: bool = True,
        teacher_storage: Literal["checkpoint", "file"] = "checkpoint",
        teacher: TeacherMode = "context_distillation",
        check_teacher_premise: bool = True,
    ) -> None:
        if beta < 0:
            raise ValueError(f"ReflectiveToDirectDistillation: beta must be >= 0, got {beta}")
        if estimator not in ("exact", "sampled"):
            raise ValueError(f"ReflectiveToDirectDistillation: estimator must be 'exact' or 'sampled', got {estimator!r}")
        if teacher_storage not in ("checkpoint", "file"):
            raise ValueError(f"ReflectiveToDirectDistillation: teacher_storage must be 'checkpoint' or 'file', got {teacher_storage!r}")
        if teacher not in get_args(TeacherMode):
            raise ValueError(f"ReflectiveToDirectDistillation: teacher must be one of {get_args(TeacherMode)}, got {teacher!r}")
        if switch_step is not None and switch_step < 0:
            raise ValueError(f"ReflectiveToDirectDistillation: switch_step must be >= 0, got {switch_step}")
        self.beta = beta
        self.estimator = estimator
        self.switch_step = switch_step
        self.evaluate_direct_at_switch = evaluate_direct_at_switch
        self.teacher_storage = teacher_storage
        self.teacher = teacher
        self.check_teacher_premise = check_teacher_premise
        self.premise: Optional[dict[str, float]] = None
        self.phase = REFLECTIVE
        self._student_start: Optional[dict[str, torch.Tensor]] = None
        self.switched_at: Optional[int] = None
        self.teacher_path: Optional[str] = None
        self.records: list[dict[str, Any]] = []
        self._module: Optional[L.LightningModule] = None
        self._pending_teacher: Optional[dict[str, torch.Tensor]] = None
        self._resolved_switch: Optional[int] = None

    # ---- setup --------------------------------------------------------------------------------
    def resolved_switch_step(self, pl_module: L.LightningModule) -> int:
        rl_start = pl_module.phases.rl_start
        step = rl_start if self.switch_step is None else self.switch_step
        if step < rl_start:
            raise ValueError(
                f"ReflectiveToDirectDistillation: switch_step {step} comes before the end of the reflective SFT "
                f"(model.phases.warmstart.steps {rl_start}); stage 2 starts at or after it"
            )
        return step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._module = pl_module
        model_config = getattr(pl_module, "model_config", None)
        if self.teacher == "seed_literal" and model_config is not None and not model_config.pretrained:
            raise ValueError(
                "ReflectiveToDirectDistillation(teacher='seed_literal') restarts the student from the pretrained "
                "model M_S, but model.model builds a tiny policy at random (no name_or_path or gguf_file): there "
                "is no M_S to restart from; load a pretrained policy or use teacher context_distillation/anchor"
            )
        self._resolved_switch = self.resolved_switch_step(pl_module)
        dm = trainer.datamodule
        suite = getattr(dm, "suite", None)
        if not hasattr(suite, "direct_from_index") or not hasattr(suite, "show_gnt_in_validation"):
            raise ValueError(
                "ReflectiveToDirectDistillation needs data.suite: r3lightning.envs.reflective.ReflectiveSuite "
                f"(got {type(suite).__name__})"
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After configure_model (an in-memory tokenizer is trained on the suite's first tasks: they must not
        # depend on the switch step) and before the task stream starts. Task indices of step s on rank r:
        # (s * world + r) * tasks_per_step + j (TaskStream).
        dm = trainer.datamodule
        dm.suite.direct_from_index = self._resolved_switch * trainer.world_size * dm.tasks_per_step

    # ---- the switch ---------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.teacher == "seed_literal" and self.phase == REFLECTIVE and self._student_start is None and trainer.global_step == 0:
            self._student_start = {k: v.detach().cpu().clone() for k, v in pl_module.policy.state_dict().items()}
        if self._pending_teacher is not None:
            self._install_teacher(trainer, pl_module, self._pending_teacher)
            self._pending_teacher = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self.phase == REFLECTIVE and trainer.global_step >= self._resolved_switch:
            self._switch(trainer, pl_module)

    def _switch(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        if step > self._resolved_switch:
            rank_zero_warn(
                f"ReflectiveToDirectDistillation: switching at step {step}, after the configured step "
                f"{self._resolved_switch} (a run resumed without this callback's state?)"
            )
        self.phase, self.switched_at = DISTILL, step
        if self.beta > 0:
            if self.check_teacher_premise:
                self._check_premise(trainer, pl_module)
            self._install_teacher(trainer, pl_module, None)
            if self.teacher == "seed_literal":
                self._restart_student(trainer, pl_module)
            if self.teacher_storage == "file":
                self.teacher_path = os.path.join(log_dir_of(trainer), f"teacher_step{step}.pt")
                if trainer.is_global_zero:
                    os.makedirs(os.path.dirname(self.teacher_path), exist_ok=True)
                    torch.save(pl_module.teacher.state_dict(), self.teacher_path)
        rank_zero_info(
            f"[r3lightning] ReflectRL: stage 2 from step {step}: direct prompts"
            + (f", teacher KL beta={self.beta} ({self.estimator}, {self.teacher})" if self.beta > 0 else ", no teacher (beta 0)")
        )

    def _check_premise(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The premise gate (``check_teacher_premise``), run at the switch with the stage-1 policy, which is
        the teacher: greedy success on the validation questions with a GNT, shown it and not."""
        dm = trainer.datamodule
        suite = dm.suite
        tasks = [t for t in suite.val_tasks() if t.data.get("reflective_prompt")][trainer.global_rank :: trainer.world_size]
        shown = suite.show_gnt_in_validation
        training = pl_module.policy.training
        pl_module.policy.eval()
        try:
            suite.show_gnt_in_validation = True
            with_gnt = dm.evaluate(tasks, greedy=True)
            suite.show_gnt_in_validation = False
            direct = dm.evaluate(tasks, greedy=True)
        finally:
            suite.show_gnt_in_validation = shown
            pl_module.policy.train(training)
        sums = paired_success_sums(torch.tensor([float(t.success) for t in with_gnt], dtype=torch.float64),
                                   torch.tensor([float(t.success) for t in direct], dtype=torch.float64))
        if trainer.world_size > 1:
            sums = trainer.strategy.reduce(sums.to(pl_module.device), reduce_op="sum").cpu()
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
        if self.teacher != "context_distillation" or figures["gain"] > 0:
            rank_zero_info(line)
            return
        line += ": not better, so the context-distillation teacher has no reflective skill to transfer"
        if any(isinstance(cb, ComponentHealth) and cb.strict for cb in trainer.callbacks):
            raise InertComponentError(f"health.strict: {line} (ReflectiveToDirectDistillation.check_teacher_premise)")
        rank_zero_warn(line)

    def _install_teacher(self, trainer: L.Trainer, pl_module: L.LightningModule, weights: Optional[dict]) -> None:
        """Teacher = a frozen copy of the policy (with ``weights`` loaded when given) set on the module."""
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                "ReflectiveToDirectDistillation: the teacher cannot be copied from an FSDP-sharded policy; "
                "use DDP or one device"
            )
        teacher = copy.deepcopy(pl_module.policy)
        if weights is not None:
            teacher.load_state_dict(weights)
        for param in teacher.parameters():
            param.grad = None
        contexts = self._teacher_contexts(trainer, pl_module) if self.teacher == "context_distillation" else None
        pl_module.set_teacher(teacher, self.beta, self.estimator, contexts)

    @staticmethod
    def _teacher_contexts(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[tuple[int, ...], list[int]]:
        """The teacher's prompt tokens keyed by the student's: each training question's direct prompt and
        its reflective prompt, rendered the way the rollout renders a first prompt."""
        suite = trainer.datamodule.suite
        chat = ChatFormatter(pl_module.tokenizer, suite.system_prompt)
        return {tuple(chat.first_prompt(direct)): chat.first_prompt(reflective) for direct, reflective in suite.teacher_prompts().items()}

    def _restart_student(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The seed's pipeline: the student is M_S again (its weights when training began), a fresh
        optimizer state, and the reflective policy is only its teacher."""
        if self._student_start is None:
            raise ValueError(
                "ReflectiveToDirectDistillation(teacher='seed_literal'): no weights of the student from the start "
                "of training (the run resumed from a checkpoint made without teacher='seed_literal')"
            )
        pl_module.policy.load_state_dict(self._student_start)
        for optimizer in trainer.optimizers:
            optimizer.state.clear()
        self._student_start = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        pl_module.log("distill/phase", 1.0 if self.phase == DISTILL else 0.0, on_step=True, batch_size=1)
        pl_module.log("distill/beta", float(self.beta if self.phase == DISTILL else 0.0), on_step=True, batch_size=1)
        if pl_module.teacher is not None:
            pl_module.log("distill/teacher_param_distance", parameter_distance(pl_module.policy, pl_module.teacher),
                          on_step=True, batch_size=1)

    # ---- validation ---------------------------------------------------------------------------
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.datamodule.suite.show_gnt_in_validation = self.phase == REFLECTIVE

    def _at_switch_validation(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        return (
            self.phase == REFLECTIVE
            and trainer.state.fn == "fit"
            and not trainer.sanity_checking
            and trainer.global_step == self._resolved_switch
            and not getattr(pl_module, "skips_validation", False)
        )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self.evaluate_direct_at_switch and self._at_switch_validation(trainer, pl_module)):
            return
        dm = trainer.datamodule
        suite = dm.suite
        tasks = suite.val_tasks()[trainer.global_rank :: trainer.world_size]
        suite.show_gnt_in_validation = False
        try:
            greedy = dm.evaluate(tasks, greedy=True)
            sampled = dm.evaluate(tasks, greedy=False)
        finally:
            suite.show_gnt_in_validation = True
        n = max(len(tasks), 1)
        figures = {
            "val_direct/success_rate_greedy": sum(t.success for t in greedy) / n,
            "val_direct/success_rate": sum(t.success for t in sampled) / n,
            "val_direct/response_len": sum(t.num_response_tokens for t in greedy) / n,
        }
        for name, value in figures.items():
            pl_module.log(name, value, sync_dist=True, batch_size=1)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or getattr(pl_module, "skips_validation", False):
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "val_direct/"))}
        at_switch = self._at_switch_validation(trainer, pl_module)
        if not at_switch:
            metrics = {k: v for k, v in metrics.items() if not k.startswith("val_direct/")}
        mode = "reflective" if self.phase == REFLECTIVE else "direct"
        self.records.append({"step": trainer.global_step, "stage": 1 if self.phase == REFLECTIVE else 2, "mode": mode, **metrics})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
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
        log_dir = log_dir_of(trainer)
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, "reflectrl_report.json"), "w") as handle:
            json.dump({"switch_step": self._resolved_switch, "switched_at": self.switched_at, "beta": self.beta,
                       "estimator": self.estimator, "teacher": self.teacher, "premise": self.premise,
                       "records": self.records}, handle, indent=2)

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        teacher = self._module.teacher if self._module is not None else None
        weights = None
        if teacher is not None and self.teacher_storage == "checkpoint":
            weights = {k: v.detach().cpu().clone() for k, v in teacher.state_dict().items()}
        elif self._pending_teacher is not None and self.teacher_storage == "checkpoint":
            weights = self._pending_teacher
        return {
            "phase": self.phase,
            "beta": self.beta,
            "estimator": self.estimator,
            "teacher_mode": self.teacher,
            "switch_step": self._resolved_switch if self._resolved_switch is not None else self.switch_step,
            "switched_at": self.switched_at,
            "teacher": weights,
            "teacher_path": self.teacher_path,
            "student_start": self._student_start,
            "records": self.records,
            "premise": self.premise,
        }

    @staticmethod
    def check_state_dict(state: dict[str, Any]) -> None:
        """``ValueError("<field>: <problem>")`` for a damaged state (checked before any is restored)."""
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.phase = state_dict["phase"]
        self.switched_at = state_dict.get("switched_at")
        self.teacher_path = state_dict.get("teacher_path")
        self.records = list(state_dict.get("records", []))
        self.premise = state_dict.get("premise")
        if self.teacher == "seed_literal" and self.phase == REFLECTIVE and state_dict.get("student_start") is not None:
            self._student_start = state_dict["student_start"]
        # Checkpoints made before the ``teacher`` knob had the anchor teacher.
        for name, saved in (("beta", state_dict["beta"]), ("estimator", state_dict["estimator"]),
                            ("teacher", state_dict.get("teacher_mode", "anchor"))):
            # Before the switch nothing has used them yet: the configured values apply (a stage-1 checkpoint
            # can start stage-2 runs with several betas). After it, the run goes on as it was.
            if self.phase == DISTILL and saved != getattr(self, name):
                rank_zero_warn(
                    f"ReflectiveToDirectDistillation: resuming in stage 2 with the checkpoint's {name}={saved!r}, not "
                    f"the configured {getattr(self, name)!r}"
                )
                setattr(self, name, saved)
        saved_switch = state_dict.get("switch_step")
        if saved_switch is not None and self._resolved_switch is not None and saved_switch != self._resolved_switch:
            raise ValueError(
                f"ReflectiveToDirectDistillation: the checkpoint was made for a switch at step {saved_switch}, this run "
                f"switches at {self._resolved_switch}; the task stream would not match"
            )
        if self.phase == DISTILL and self.beta > 0:
            weights = state_dict.get("teacher")
            if weights is None:
                if not self.teacher_path or not os.path.isfile(self.teacher_path):
                    raise ValueError(
                        "ReflectiveToDirectDistillation: the checkpoint is in stage 2 but holds no teacher weights and its "
                        f"teacher file {self.teacher_path!r} does not exist"
                    )
                weights = torch.load(self.teacher_path, map_location="cpu", weights_only=True)
            self._pending_teacher = weights


def parameter_distance(student: torch.nn.Module, teacher: torch.nn.Module) -> float:
    """‖θ_student − θ_teacher‖₂ / ‖θ_teacher‖₂ over all parameters (0.0 when they are the same weights)."""
    with torch.no_grad():
        diff = sum(float((s.float() - t.float()).pow(2).sum()) for s, t in zip(student.parameters(), teacher.parameters()))
        norm = sum(float(t.float().pow(2).sum()) for t in teacher.parameters())
    return (diff / max(norm, 1e-30)) ** 0.5
