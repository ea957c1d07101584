"""Report validation success at the end of the SFT warm-up and at the end of training."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L

from r3lightning.callbacks.monitor import log_dir_of


ROLLOUT_FIGURES = (
    "rollout/retry_improvement_rate",
    "rollout/reflection_invalid_rate",
    "rollout/retry_rate",
    "rollout/reflection_outcome_agreement",
)
"""Printed at the end of fit as percentages (means over RL steps)."""

RECORDED_FIGURES = (
    "rollout/generated_tokens",
    "rollout/response_len",
    "rollout/pivot_late_share",
    "rollout/retry_tokens_saved_share",
    "rollout/replay_failures",
    "rollout/success_judgment_samples",
    "train/zero_variance_group_rate",
    "train/zero_variance_group_rate_before_replay",
    "replay/rescued_group_rate",
    "reward/ranking_bonus_mean",
    "rollout/in_context_task_rate",
)
"""Also averaged over RL steps into ``phase_report.json`` (what a method spent, where its pivots fell)."""


class PhaseReport(L.Callback):
    """Collects ``val/*`` after every validation, tagged with the phase, and prints a summary.

    The summary names the last validation of the warm-up phase (the one run at the step where RL
    begins) and the last validation overall, plus the mean over RL steps of the explorer's
    reflect-then-retry figures (``ROLLOUT_FIGURES``, when the explorer logs them), and is written to
    ``<log_dir>/phase_report.json``.
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.rollout_sums: dict[str, float] = {}
        self.rollout_steps: dict[str, int] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        for name in ROLLOUT_FIGURES + RECORDED_FIGURES:
            if name in trainer.callback_metrics:
                self.rollout_sums[name] = self.rollout_sums.get(name, 0.0) + float(trainer.callback_metrics[name])
                self.rollout_steps[name] = self.rollout_steps.get(name, 0) + 1

    def rollout_means(self) -> dict[str, float]:
        return {name: self.rollout_sums[name] / self.rollout_steps[name] for name in self.rollout_sums}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or getattr(pl_module, "skips_validation", False):
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        warmup_steps = getattr(getattr(pl_module, "phases", None), "sft_warmup_steps", 0)
        phase = "warmup" if trainer.global_step <= warmup_steps and warmup_steps > 0 else "rl"
        self.records.append({"step": trainer.global_step, "phase": phase, **metrics})

    def summary(self) -> dict[str, Any]:
        warmup = [r for r in self.records if r["phase"] == "warmup"]
        return {
            "after_warmup": warmup[-1] if warmup else None,
            "final": self.records[-1] if self.records else None,
            "rl_rollout_means": self.rollout_means(),
            "history": self.records,
        }

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self.records:
            return
        summary = self.summary()
        lines = ["[r3lightning] validation success rate (greedy / sampled):"]
        for label, record in (("after warm-start", summary["after_warmup"]), ("after RL", summary["final"])):
            if record is not None:
                lines.append(
                    f"  {label:<17} step {record['step']:>5}: "
                    f"{100 * record.get('val/success_rate_greedy', float('nan')):5.1f}% / "
                    f"{100 * record.get('val/success_rate', float('nan')):5.1f}%"
                )
        for name, value in summary["rl_rollout_means"].items():
            if name in ROLLOUT_FIGURES:
                lines.append(f"  {name} (mean over {self.rollout_steps[name]} RL steps): {100 * value:.1f}%")
        print("\n".join(lines), flush=True)
        log_dir = log_dir_of(trainer)
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, "phase_report.json"), "w") as handle:
            json.dump(summary, handle, indent=2)

    def state_dict(self) -> dict[str, Any]:
        return {"records": self.records, "rollout_sums": self.rollout_sums, "rollout_steps": self.rollout_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = list(state_dict.get("records", []))
        self.rollout_sums = dict(state_dict.get("rollout_sums", {}))
        self.rollout_steps = dict(state_dict.get("rollout_steps", {}))
