"""The phases of one ``fit`` run (``model.phases``) and the one object that says which phase a step is in.

A run is an ordered list of phases: the warm-start (SFT on demonstrations) for ``warmstart.steps``
optimizer steps, then RL on the policy's own rollouts until ``trainer.max_steps``, and, when
``distill.enabled``, ReflectRL's distillation from ``distill.start`` on (RL on direct tasks whose
rollouts a frozen teacher also scores). Each phase says where its samples come from, which objective
trains on them, its learning rate and its teacher. Every reader that needs to know what step ``s``
does (the module's step, its learning rate and validations, the checkpoint checks, the phase report,
callbacks) asks ``PhaseSchedule.at(s)``; nothing else compares a step with a phase's first step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from r3lightning.data.demonstrations import DemoConfig

PhaseName = Literal["warmstart", "rl", "distill"]
SampleSource = Literal["demonstrations", "rollouts", "teacher_scored_rollouts"]
TeacherMode = Literal["context_distillation", "seed_literal", "anchor"]

REPLACED_KEYS = {
    "model.phases.sft_warmup_steps": "model.phases.warmstart.steps",
    "model.phases.validate_during_sft": "model.phases.warmstart.validate",
    "model.phases.reset_optimizer_for_rl": "model.phases.rl.reset_optimizer",
    "model.optim.sft_lr": "model.phases.warmstart.lr",
    "data.demos": "model.phases.warmstart.demos",
}
"""The keys the phase schedule replaced, and the key to set instead (``data.demos.X``:
``model.phases.warmstart.demos.X``)."""

REPLACED_CALLBACKS = {
    "ReflectiveToDirectDistillation": (
        "model.phases.distill (enabled: true; its init_args are model.phases.distill.beta, .estimator, .teacher, "
        ".teacher_storage, .evaluate_direct_at_switch, .check_teacher_premise, and switch_step is "
        "model.phases.distill.start)"
    ),
}
"""Callbacks of ``r3lightning.callbacks`` that became phases of the schedule (class name -> what to set
instead); ``r3l`` refuses a config that still names one (``r3lightning.cli.moved_names``)."""


@dataclass
class WarmStartPhase:
    """SFT on demonstrations, before RL (its samples: ``Demonstrations``, ``data/demonstrations.py``).

    Args:
        steps: optimizer steps of the warm-start (0: none, RL from the first step).
        lr: its learning rate (null: ``model.optim.lr``).
        validate: run the trainer's periodic validations during the warm-start too. Off, validations
            before its last step are skipped, so the first one measures the finished warm-start (make
            ``steps`` a multiple of ``trainer.val_check_interval``). Validation forks the CPU random
            stream, so on CPU skipping it leaves training unchanged.
        demos: where its demonstrations come from and what they hold.
    """

    steps: int = 0
    lr: Optional[float] = None
    validate: bool = True
    demos: DemoConfig = field(default_factory=DemoConfig)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"model.phases.warmstart.steps must be >= 0, got {self.steps}")


@dataclass
class RLPhase:
    """RL on the policy's own rollouts (``data.explorer``) under ``model.algorithm``, at ``model.optim.lr``,
    from the end of the warm-start to ``trainer.max_steps``.

    Args:
        reset_optimizer: after a warm-start, clear the optimizer's state (AdamW's moments) at the first
            RL step, as a separate SFT-then-RL pipeline would. Cross-entropy gradients are several times
            larger than policy-gradient ones, and the second moment they leave behind decays over
            ~1/(1 - beta2) = 1000 steps: until then every RL update is divided by the SFT gradients'
            scale, a silent cut of RL's learning rate.
    """

    reset_optimizer: bool = True


@dataclass
class DistillPhase:
    """ReflectRL's stage 2, reflective-to-direct distillation (docs/reflectrl.md), after the reflective
    stage 1 (the warm-start, and RL on reflective tasks when ``start`` comes later). Needs ``data.suite:
    r3lightning.envs.reflective.ReflectiveSuite``. From ``start`` to ``trainer.max_steps`` the training
    tasks are the suite's direct ones (a pure function of the task index), validation shows no golden
    negative, and every RL step also pays ``beta · KL(π_student ‖ π_teacher)`` on its rollouts' response
    tokens (token mean over the step's RL tokens), on top of ``model.algorithm``'s objective. The
    teacher is a frozen copy of the policy taken at ``start`` (``r3lightning/training/distillation.py``).
    Logged every step: ``distill/phase`` (0 before, 1 in it), ``distill/beta`` (the weight in force),
    ``distill/teacher_param_distance``; the end of fit writes ``<log_dir>/reflectrl_report.json``.

    Args:
        enabled: run the phase (off: the run has no distillation; the other fields are not read).
        start: its first optimizer step; null: when the warm-start (stage 1's reflective SFT) ends. It
            may not come before that.
        beta: weight of KL(π_student ‖ π_teacher) per RL token. 0 switches the data only, with no
            teacher (the "GT+ only" baseline of docs/reflectrl.md).
        estimator: ``exact`` (the KL over the whole vocabulary at each position, one extra teacher
            forward per micro-batch) or ``sampled`` (the k3 estimate from the sampled tokens'
            log-probs: cheaper to reduce, noisier).
        teacher: what the teacher is and what it sees (docs/reflectrl.md, "The teacher").
            ``context_distillation``: the policy at ``start``, scoring the student's direct response
            tokens under the *reflective* prompt of the same question (the question's first training
            golden negative in context; a question without one is scored under its direct prompt,
            counted in ``distill/teacher_context_rate``); the student goes on from the same weights.
            ``seed_literal``: the teacher is the policy at ``start`` scoring in the direct context,
            and the student restarts from the weights it had when training began (the optimizer state
            is reset); needs a pretrained policy (``model.model.name_or_path`` or ``gguf_file``).
            ``anchor``: the policy at ``start`` in the student's own direct context, a KL anchor that
            is zero at the phase's first step.
        teacher_storage: where the teacher's weights are saved: ``checkpoint`` (in every checkpoint) or
            ``file`` (once, to ``<log_dir>/teacher_step<S>.pt``; checkpoints keep only its path, which
            must still exist on resume).
        evaluate_direct_at_switch: at a validation run at ``start`` (the last of stage 1, which shows the
            golden negatives), also run the validation questions directly, logged as
            ``val_direct/success_rate_greedy``, ``val_direct/success_rate`` and
            ``val_direct/response_len``. Make ``start`` a multiple of ``trainer.val_check_interval``.
        check_teacher_premise: with a teacher (beta > 0), measure first whether it answers better with a
            golden negative in its prompt than without one (docs/reflectrl.md, "The premise gate"):
            greedy success of the policy at ``start`` on the validation questions that have one, with it
            in the prompt and without, paired per question. Logged once as
            ``distill/premise_success_with_gnt``, ``distill/premise_success_direct``,
            ``distill/premise_gain`` (with − direct), ``distill/premise_gain_se`` and
            ``distill/premise_questions``, printed and kept in the report. A ``context_distillation``
            teacher that is not better is warned about; under ``health.strict`` the run stops
            (``InertComponentError``) before the phase trains.
    """

    enabled: bool = False
    start: Optional[int] = None
    beta: float = 0.05
    estimator: Literal["exact", "sampled"] = "exact"
    teacher: TeacherMode = "context_distillation"
    teacher_storage: Literal["checkpoint", "file"] = "checkpoint"
    evaluate_direct_at_switch: bool = True
    check_teacher_premise: bool = True

    def __post_init__(self) -> None:
        if self.beta < 0:
            raise ValueError(f"model.phases.distill.beta must be >= 0, got {self.beta}")
        if self.estimator not in ("exact", "sampled"):
            raise ValueError(f"model.phases.distill.estimator must be 'exact' or 'sampled', got {self.estimator!r}")
        if self.teacher not in get_args(TeacherMode):
            raise ValueError(f"model.phases.distill.teacher must be one of {get_args(TeacherMode)}, got {self.teacher!r}")
        if self.teacher_storage not in ("checkpoint", "file"):
            raise ValueError(f"model.phases.distill.teacher_storage must be 'checkpoint' or 'file', got {self.teacher_storage!r}")
        if self.start is not None and self.start < 0:
            raise ValueError(f"model.phases.distill.start must be >= 0, got {self.start}")


@dataclass(frozen=True)
class Phase:
    """What the steps ``start`` to ``end`` (exclusive; None: to the end of the run) do.

    name: ``warmstart``, ``rl`` or ``distill``. samples: ``demonstrations`` (the warm-start's producer,
    all for the SFT head), ``rollouts`` (the explorer's, trained by ``model.algorithm``) or
    ``teacher_scored_rollouts`` (the explorer's rollouts of direct tasks, which the frozen teacher
    scores too: ``model.algorithm`` plus the teacher's KL). lr: its learning rate (None:
    ``model.optim.lr``). validate: whether the trainer's periodic validations run in it. teacher: the
    teacher's mode (``DistillPhase.teacher``), None without one. lr_span: the first step and the end
    of its learning-rate schedule (warm-up, decay); None: the phase's own. RL and distillation share
    one, from the warm-start's end to the run's end: the distillation goes on with RL's optimizer."""

    name: PhaseName
    start: int
    end: Optional[int]
    samples: SampleSource
    lr: Optional[float]
    validate: bool
    teacher: Optional[TeacherMode] = None
    lr_span: Optional[tuple[int, Optional[int]]] = None

    @property
    def is_rl(self) -> bool:
        """Whether the phase trains on rollouts with the RL objective (else: SFT on demonstrations)."""
        return self.samples != "demonstrations"

    @property
    def schedule(self) -> tuple[int, Optional[int]]:
        """The first step and the end (None: the run's) its learning rate's warm-up and decay count over."""
        return self.lr_span if self.lr_span is not None else (self.start, self.end)


@dataclass
class PhaseSchedule:
    """The phases of one ``fit`` run, in the order they run: ``warmstart`` (SFT on demonstrations, its
    ``steps`` steps), then ``rl`` until ``trainer.max_steps`` or, when ``distill.enabled``, until
    ``distill.start``, and then ``distill`` (ReflectRL's stage 2) until ``trainer.max_steps``.

    Args:
        warmstart: the warm-start: its length, learning rate, validations and demonstrations.
        rl: RL on the policy's rollouts.
        distill: ReflectRL's reflective-to-direct distillation (off by default).
    """

    warmstart: WarmStartPhase = field(default_factory=WarmStartPhase)
    rl: RLPhase = field(default_factory=RLPhase)
    distill: DistillPhase = field(default_factory=DistillPhase)

    def __setstate__(self, state: dict) -> None:
        # The hyper-parameters of a checkpoint written before the distillation phase existed hold no ``distill``.
        self.__dict__.update({"distill": DistillPhase(), **state})

    def phases(self) -> list[Phase]:
        """The run's phases in order (a warm-start of 0 steps, and an RL phase that distillation starts
        at once, are left out)."""
        warm, distill_start = self.warmstart, self.distill_start
        found = [Phase("warmstart", 0, warm.steps, "demonstrations", warm.lr, warm.validate)] if warm.steps > 0 else []
        span = (warm.steps, None)  # RL and distillation: one learning-rate schedule
        if distill_start is None or distill_start > warm.steps:
            found.append(Phase("rl", warm.steps, distill_start, "rollouts", None, True, lr_span=span))
        if distill_start is not None:
            distill = self.distill
            with_teacher = distill.beta > 0
            found.append(Phase("distill", max(distill_start, warm.steps), None,
                               "teacher_scored_rollouts" if with_teacher else "rollouts", None, True,
                               teacher=distill.teacher if with_teacher else None, lr_span=span))
        return found

    def at(self, step: int) -> Phase:
        """The phase optimizer step ``step`` (0-based) trains in."""
        return next(p for p in self.phases() if p.end is None or step < p.end)

    def before(self, step: int) -> Phase:
        """The phase whose last step ran before ``step``: the one a validation after ``step`` optimizer
        steps measures (the first phase at step 0)."""
        return self.at(max(step - 1, 0))

    @property
    def rl_start(self) -> int:
        """The first RL step (the warm-start's length)."""
        return self.warmstart.steps

    @property
    def distill_start(self) -> Optional[int]:
        """The distillation phase's first step (``distill.start``, or the warm-start's end), None without one."""
        if not self.distill.enabled:
            return None
        return self.rl_start if self.distill.start is None else self.distill.start

    def demonstrations(self) -> Optional[DemoConfig]:
        """The warm-start's demonstrations, None without a warm-start."""
        return self.warmstart.demos if self.warmstart.steps > 0 else None

    def rl_begins_after_warmstart(self, step: int) -> bool:
        """Whether ``step`` is the first RL step after a warm-start (the optimizer's reset, the KL
        reference's re-anchoring)."""
        return 0 < self.rl_start == step

    def distill_begins(self, step: int) -> bool:
        """Whether ``step`` is the distillation phase's first step (its teacher's snapshot; the validation
        after ``step`` optimizer steps is stage 1's last)."""
        phase = self.at(step)
        return phase.name == "distill" and phase.start == step

    def past_warmstart(self, step: int) -> bool:
        """Whether a run at ``step`` has had a warm-start and its first RL step (its reference re-anchored)."""
        return 0 < self.rl_start < step

    def check(self, max_steps: int) -> Optional[str]:
        """Refuse success reflections that would start after the warm-start (they would never be played)
        and a distillation that would start before the warm-start's end; a warning when the warm-start
        fills the whole run (SFT only, allowed), else None."""
        distill_start = self.distill_start
        if distill_start is not None and distill_start < self.rl_start:
            raise ValueError(
                f"model.phases.distill.start ({distill_start}) comes before the end of the reflective SFT "
                f"(model.phases.warmstart.steps {self.rl_start}); the distillation starts at or after it"
            )
        demos = self.warmstart.demos
        if self.warmstart.steps > 0 and demos.reflections and demos.success_reflection_share > 0 and demos.success_reflection_from_step >= self.warmstart.steps:
            raise ValueError(
                f"model.phases.warmstart.demos.success_reflection_from_step ({demos.success_reflection_from_step}) >= "
                f"model.phases.warmstart.steps ({self.warmstart.steps}): no warm-start step would play a clean "
                "success episode; start it earlier or set model.phases.warmstart.demos.success_reflection_share to 0"
            )
        if 0 < max_steps <= self.warmstart.steps:
            return (
                f"model.phases.warmstart.steps ({self.warmstart.steps}) >= trainer.max_steps ({max_steps}): "
                "this run is SFT only, no RL step will run"
            )
        return None


def replaced_key_note(message: str) -> str:
    """For a parser error ``message`` that names a key the phase schedule replaced
    (``model.phases.sft_warmup_steps`` and the like), a note naming the key to set instead; else ""."""
    # jsonargparse names a key in full (``--model.phases.x``, ``Subcommand 'fit' does not accept option
    # 'model.phases.x'``) or within its group (``Group 'model' does not accept option 'phases.x'``).
    named = re.findall(r"--([\w.]+)", message) + re.findall(r"'([\w.]+)'", message)
    named += [f"{group}.{key}" for group, key in re.findall(r"Group '([\w.]+)' does not accept \w+(?: \w+)? '([\w.]+)'", message)]
    notes = [f"{old} was replaced by {new}" for old, new in REPLACED_KEYS.items()
             if any(key == old or key.startswith(old + ".") for key in named)]
    return ("; " + "; ".join(dict.fromkeys(notes))) if notes else ""
