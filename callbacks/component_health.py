"""Component health: a method component that is switched on must be seen acting.

For every component the run's configuration switches on (``r3lightning.data.components``), this sums
its activity figure over RL steps and keeps the figure of its degeneracy rule. After ``after_steps`` RL
steps with the component on (or at the end of a shorter fit) it judges the component once: an activity
sum of 0 is *inert*, a degeneracy rule that holds is *degenerate*. Each finding is one warning naming the
component, the figure and the key that controls it; with ``strict`` the first judgement that finds any
stops the run with an error (``r3l`` exits 1). Comparison scripts run strict, so no arm is reported
whose component did nothing (docs/monitoring.md, "Component activity").
"""

from __future__ import annotations

from typing import Optional

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from r3lightning.callbacks.update_size import update_kl
from r3lightning.data.components import TEACHER_CHECK, ComponentCheck, component_checks
from r3lightning.types import ExperienceBatch, step_output


class HealthRefusal(ValueError):
    """A strict run stopped by a health check: a comparison records the arm as refused, not reported."""


class InertComponentError(HealthRefusal):
    """A strict run found a switched-on component inert or degenerate."""


class UpdateSizeError(HealthRefusal):
    """A strict run made an RL update larger than ``health.update_kl_max``."""


class _Tally:
    def __init__(self, check: ComponentCheck) -> None:
        self.check = check
        self.steps = 0
        self.activity = 0.0
        self.degenerate_values: list[float] = []
        self.judged = False

    def add(self, metrics: dict[str, float]) -> None:
        self.steps += 1
        self.activity += abs(float(metrics.get(self.check.activity, 0.0)))
        rule = self.check.degenerate
        if rule is not None and rule.figure in metrics:
            self.degenerate_values.append(float(metrics[rule.figure]))

    def finding(self) -> Optional[str]:
        check = self.check
        if self.activity == 0.0:
            return (
                f"{check.component} is switched on but inert: {check.activity} was 0 over {self.steps} RL steps "
                f"(controlled by {check.key})"
            )
        rule = check.degenerate
        value = rule.holds(self.degenerate_values) if rule is not None else None
        if value is not None:
            bound = ">=" if rule.above else "<="
            return (
                f"{check.component} is degenerate: {rule.figure} = {value:.4g} ({rule.reduce} over {self.steps} RL steps, "
                f"{bound} {rule.threshold:g}): {rule.meaning} (controlled by {check.key})"
            )
        return None


class ComponentHealth(L.Callback):
    """Warns (or, ``strict``, stops the run) when a switched-on method component is inert or degenerate.

    ``r3l`` adds it to every fit; its settings are the ``health:`` section (``--health.strict true``).

    It also guards the size of each RL update (``callbacks/update_size.py``): after every RL step it
    logs ``health/update_kl``, the KL from the policy that sampled the step to the updated one on the
    step's own tokens, and one above ``update_kl_max`` is reported with the numbers and what to change
    (strict: the run stops before the next step).

    Args:
        after_steps: RL steps with a component on after which it is judged (a shorter fit judges at its end).
        strict: raise ``InertComponentError`` or ``UpdateSizeError`` (exit status 1 under ``r3l``) instead of warning.
        update_kl_max: the largest per-token KL(behaviour || updated policy) one RL step may reach before it is
            reported (null: not measured). Healthy steps stay around 1e-3 to 1e-2 nats/token; a learning rate
            that wrecks a pretrained model in one update gives whole nats.
        update_kl_rows: RL rows of the step the KL is measured on (one extra forward pass of that many rows).
    """

    def __init__(self, after_steps: int = 20, strict: bool = False, update_kl_max: Optional[float] = 1.0,
                 update_kl_rows: int = 8) -> None:
        if after_steps < 1:
            raise ValueError(f"health.after_steps must be >= 1, got {after_steps}")
        if update_kl_max is not None and not update_kl_max > 0:
            raise ValueError(f"health.update_kl_max must be > 0 (or null), got {update_kl_max}")
        if update_kl_rows < 1:
            raise ValueError(f"health.update_kl_rows must be >= 1, got {update_kl_rows}")
        self.after_steps = after_steps
        self.strict = strict
        self.update_kl_max = update_kl_max
        self.update_kl_rows = update_kl_rows
        self.update_warned = False
        self.tallies: list[_Tally] = []
        self.findings: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dm = trainer.datamodule
        checks = component_checks(pl_module.algorithm, dm.explorer, dm.replay, dm.agent)
        self.tallies = [_Tally(check) for check in checks]
        self.findings = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = step_output(outputs)  # the step's own scalars (``trainer.callback_metrics`` keeps stale ones)
        metrics = step["metrics"]
        if metrics.get("train/phase_rl", 0.0) != 1.0:
            return
        self._check_update_size(trainer, pl_module, step["experience"])
        if getattr(pl_module, "teacher", None) is not None and getattr(pl_module, "teacher_kl_coef", 0.0) > 0:
            if not any(t.check is TEACHER_CHECK for t in self.tallies):
                self.tallies.append(_Tally(TEACHER_CHECK))
        for tally in self.tallies:
            if tally.check is TEACHER_CHECK and getattr(pl_module, "teacher", None) is None:
                continue
            if not tally.judged:
                tally.add(metrics)
        self._judge([t for t in self.tallies if not t.judged and t.steps >= self.after_steps])

    def _check_update_size(self, trainer, pl_module, experience: Optional[ExperienceBatch]) -> None:
        if self.update_kl_max is None or experience is None or getattr(pl_module, "policy", None) is None:
            return
        measured = update_kl(pl_module.policy, experience, self.update_kl_rows)
        if measured is None:
            return
        kl, tokens = measured
        pl_module.log("health/update_kl", kl, on_step=True, on_epoch=False, batch_size=1)
        if kl <= self.update_kl_max or (self.update_warned and not self.strict):
            return
        self.update_warned = True
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
        message = (
            f"health: RL step {trainer.global_step} moved the policy by KL {kl:.3g} nats/token (from the policy that "
            f"sampled the step to the updated one, on {tokens} of the step's own tokens), above health.update_kl_max="
            f"{self.update_kl_max:g}; an update this large usually wrecks a pretrained model. The learning rate was "
            f"{lr:.3g}: lower model.optim.lr (1e-6 to 1e-5 suits a pretrained model) or the largest gradient norm "
            "model.optim.grad_clip"
        )
        if self.strict:
            raise UpdateSizeError(f"health.strict: {message} (the run stops before the next step)")
        rank_zero_warn(f"[r3lightning] {message}")

    def on_teacher_premise_failed(self, trainer, pl_module, finding: str) -> None:
        """ReflectRL's distillation phase found its context-distillation teacher no better with a golden
        negative in its prompt (``model.phases.distill.check_teacher_premise``, asked by
        ``r3lightning.training.distillation`` before the phase trains): strict, the run stops here (else the
        distillation warns)."""
        if self.strict:
            raise InertComponentError(f"health.strict: {finding} (model.phases.distill.check_teacher_premise)")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._judge([t for t in self.tallies if not t.judged and t.steps > 0])

    def _judge(self, tallies: list[_Tally]) -> None:
        found = []
        for tally in tallies:
            tally.judged = True
            finding = tally.finding()
            if finding:
                found.append(finding)
        self.findings += found
        for finding in found:
            rank_zero_warn(f"[r3lightning] health: {finding}")
        if found and self.strict:
            raise InertComponentError("health.strict: " + "; ".join(found))
