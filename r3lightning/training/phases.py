"""The phases of one ``fit`` run (``model.phases``) and the one object that says which phase a step is in.

A run is an ordered list of phases: the warm-start (SFT on demonstrations) for ``warmstart.steps``
optimizer steps, then RL on the policy's own rollouts until ``trainer.max_steps``. Each phase says
where its samples come from, which objective trains on them and its learning rate. Every reader that
needs to know what step ``s`` does (the module's step, its learning rate and validations, the
checkpoint checks, the phase report, callbacks) asks ``PhaseSchedule.at(s)``; nothing else compares a
step with the warm-start's length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from r3lightning.data.demonstrations import DemoConfig

PhaseName = Literal["warmstart", "rl"]
SampleSource = Literal["demonstrations", "rollouts"]

REPLACED_KEYS = {
    "model.phases.sft_warmup_steps": "model.phases.warmstart.steps",
    "model.phases.validate_during_sft": "model.phases.warmstart.validate",
    "model.phases.reset_optimizer_for_rl": "model.phases.rl.reset_optimizer",
    "model.optim.sft_lr": "model.phases.warmstart.lr",
    "data.demos": "model.phases.warmstart.demos",
}
"""The keys the phase schedule replaced, and the key to set instead (``data.demos.X``:
``model.phases.warmstart.demos.X``)."""


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


@dataclass(frozen=True)
class Phase:
    """What the steps ``start`` to ``end`` (exclusive; None: to the end of the run) do.

    name: ``warmstart`` or ``rl``. samples: ``demonstrations`` (the warm-start's producer, all for the
    SFT head) or ``rollouts`` (the explorer's, trained by ``model.algorithm``). lr: its learning rate
    (None: ``model.optim.lr``). validate: whether the trainer's periodic validations run in it."""

    name: PhaseName
    start: int
    end: Optional[int]
    samples: SampleSource
    lr: Optional[float]
    validate: bool

    @property
    def is_rl(self) -> bool:
        """Whether the phase trains on rollouts with the RL objective (else: SFT on demonstrations)."""
        return self.samples == "rollouts"


@dataclass
class PhaseSchedule:
    """The phases of one ``fit`` run, in the order they run: ``warmstart`` (SFT on demonstrations, its
    ``steps`` steps), then ``rl`` until ``trainer.max_steps``.

    Args:
        warmstart: the warm-start: its length, learning rate, validations and demonstrations.
        rl: RL on the policy's rollouts.
    """

    warmstart: WarmStartPhase = field(default_factory=WarmStartPhase)
    rl: RLPhase = field(default_factory=RLPhase)

    def phases(self) -> list[Phase]:
        """The run's phases in order (a warm-start of 0 steps is left out)."""
        warm = self.warmstart
        rl = Phase("rl", warm.steps, None, "rollouts", None, True)
        if warm.steps == 0:
            return [rl]
        return [Phase("warmstart", 0, warm.steps, "demonstrations", warm.lr, warm.validate), rl]

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

    def demonstrations(self) -> Optional[DemoConfig]:
        """The warm-start's demonstrations, None without a warm-start."""
        return self.warmstart.demos if self.warmstart.steps > 0 else None

    def rl_begins_after_warmstart(self, step: int) -> bool:
        """Whether ``step`` is the first RL step after a warm-start (the optimizer's reset, the KL
        reference's re-anchoring)."""
        return 0 < self.rl_start == step

    def past_warmstart(self, step: int) -> bool:
        """Whether a run at ``step`` has had a warm-start and its first RL step (its reference re-anchored)."""
        return 0 < self.rl_start < step

    def check(self, max_steps: int) -> Optional[str]:
        """Refuse success reflections that would start after the warm-start (they would never be played);
        a warning when the warm-start fills the whole run (SFT only, allowed), else None."""
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
