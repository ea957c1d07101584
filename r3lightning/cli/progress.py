"""The progress bar of ``r3l fit``: optimizer steps, the phase, and the figures worth watching."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    """A rich progress bar of optimizer steps: ``global_step / max_steps`` (the task stream is endless,
    so Lightning's epoch counter says "Epoch 0/-2"), the phase (SFT warm-start or RL) as its
    description, and the figures worth watching (``PROGRESS_FIGURES``) instead of every ``prog_bar``
    metric."""

    PROGRESS_FIGURES = (
        ("train/loss", "loss", "{:.3f}"),
        ("reward/mean", "reward", "{:.3f}"),
        ("reward/success_rate", "success", "{:.0%}"),
        ("rollout/response_len", "len", "{:.1f}"),
        ("time/rollout_s", "rollout", "{:.1f}s"),
        ("val/success_rate_greedy", "val greedy", "{:.1%}"),
    )
    """(tag, label, format) shown after the bar, when the tag has been logged."""

    @property
    def total_train_batches(self):
        max_steps = self.trainer.max_steps
        return max_steps if max_steps is not None and max_steps > 0 else super().total_train_batches

    def _description(self, pl_module=None) -> str:
        phase = getattr(pl_module if pl_module is not None else self.trainer.lightning_module, "phase", None)
        text = {"warmstart": "SFT warm-start", "rl": "RL", "distill": "RL + distillation"}.get(getattr(phase, "name", None), "Training")
        return f"{text:{len(self.validation_description)}}"

    def _get_train_description(self, current_epoch: int) -> str:
        return self._description()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        if self.progress is not None and self.is_enabled and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self._description(pl_module))
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict[str, str]:
        metrics = trainer.callback_metrics
        return {label: fmt.format(float(metrics[tag])) for tag, label, fmt in self.PROGRESS_FIGURES if tag in metrics}
