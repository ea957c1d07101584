"""Run health: stop cleanly after repeated non-finite steps, warn about unhealthy dynamics.

The module skips an optimizer step whose loss or gradient norm is not finite, counts it
(``train/skipped_steps``) and, after ``max_bad_steps`` consecutive bad steps, sets
``trainer.should_stop`` and prints why. ``HealthWatchdog`` then saves a checkpoint of the last good
weights (the bad steps changed nothing) to ``<log_dir>/checkpoints/bad_steps_stop.ckpt`` and prints
where it is, so nothing already trained is lost. It also watches the logged dynamics and warns —
once per kind, printed and logged under ``health/*`` — about entropy collapse or explosion,
response-length blow-up, a high rate of zero-variance groups (no learning signal), prompts that do
not fit in the context and rewards that fail.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict, deque
from typing import Any, Optional

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from r3lightning.callbacks.monitor import log_dir_of
from r3lightning.data.state_checks import expect_number, expect_type
from r3lightning.types import Trajectory, step_output

BAD_STEPS_CHECKPOINT = "bad_steps_stop.ckpt"
EXCEPTION_CHECKPOINT = "exception.ckpt"


class NoRewardError(ValueError):
    """An RL step in which no sample's reward could be computed (``stop_on_failed_rewards``)."""


class HealthWatchdog(L.Callback):
    """Checkpoint-and-stop on non-finite steps; warnings about the training dynamics.

    Warnings look at RL-phase steps only, over the last ``window`` of them (means over the window):

    - ``health/entropy_collapse``: mean ``train/entropy`` below ``entropy_min`` (the policy stopped exploring).
    - ``health/entropy_explosion``: mean ``train/entropy`` above ``entropy_max`` (default:
      ``entropy_max_fraction`` of ln(vocabulary size), i.e. close to uniform: the policy is falling apart).
    - ``health/response_len_growth``: mean ``rollout/response_len`` of the last ``window`` steps divided by
      the mean of the ``window`` steps before them (logged every step once there are enough); the
      warning fires when it reaches ``length_growth_factor``.
    - ``health/zero_variance_groups``: mean ``train/zero_variance_group_rate`` above ``zero_variance_max``
      (most groups give no gradient: tasks too easy or too hard, or the policy collapsed).
    - ``health/prompt_too_long``: some episodes of the step had a prompt longer than the context limit
      (``rollout/prompt_too_long_rate`` > 0; they train nothing).
    - ``health/reward_errors``: some rewards raised, timed out or were not finite numbers (``reward/error_rate``
      > 0; masked). When every fresh sample of a step failed, ``stop_on_failed_rewards`` stops the run.

    Flags are logged every step as 0/1 (the ratio as a number); each kind is printed once per run.
    ``health/consecutive_bad_steps`` is logged every step.

    Args:
        save_checkpoint_on_bad_steps: save ``<log_dir>/checkpoints/bad_steps_stop.ckpt`` when the module stops
            after ``max_bad_steps`` consecutive non-finite steps.
        save_checkpoint_on_exception: when training dies from an exception or a second SIGTERM/SIGINT (one
            process only), save what was trained so far to ``<log_dir>/checkpoints/exception.ckpt`` (best
            effort), unless a checkpoint of the same step exists (``exception_save_plan``).
        window: RL steps the warnings average over.
        entropy_min: collapse threshold, nats per token.
        entropy_max: explosion threshold, nats per token (null: ``entropy_max_fraction`` · ln V).
        entropy_max_fraction: see ``entropy_max``.
        length_growth_factor: response-length growth between consecutive windows that warns.
        zero_variance_max: zero-variance group rate above which it warns.
        stop_on_failed_rewards: stop the run with an error (``r3l`` exits 1) after an RL step in which no
            fresh sample got a usable reward (every reward function or environment call raised, timed
            out or returned no finite number: ``reward/error_rate`` 1.0), naming the suite, the reward
            function and the first failure; nothing could be trained. A step where only some fail is
            masked, counted and warned about.
    """

    def __init__(
        self,
        save_checkpoint_on_bad_steps: bool = True,
        save_checkpoint_on_exception: bool = True,
        window: int = 10,
        entropy_min: float = 0.02,
        entropy_max: Optional[float] = None,
        entropy_max_fraction: float = 0.9,
        length_growth_factor: float = 2.0,
        zero_variance_max: float = 0.9,
        stop_on_failed_rewards: bool = True,
    ) -> None:
        if window < 1:
            raise ValueError(f"HealthWatchdog: window must be >= 1, got {window}")
        self.save_checkpoint_on_bad_steps = save_checkpoint_on_bad_steps
        self.save_checkpoint_on_exception = save_checkpoint_on_exception
        self.window = window
        self.entropy_min = entropy_min
        self.entropy_max = entropy_max
        self.entropy_max_fraction = entropy_max_fraction
        self.length_growth_factor = length_growth_factor
        self.zero_variance_max = zero_variance_max
        self.stop_on_failed_rewards = stop_on_failed_rewards
        self.stopped_on_failed_rewards = False
        self.history: dict[str, deque] = defaultdict(lambda: deque(maxlen=2 * self.window))
        self.warned: set[str] = set()
        self.stop_checkpoint: Optional[str] = None

    # ---- non-finite steps -------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        bad = int(getattr(pl_module, "consecutive_bad_steps", 0))
        limit = int(getattr(pl_module, "max_bad_steps", 0) or 0)
        values = {"health/consecutive_bad_steps": float(bad)}
        if limit > 0 and bad >= limit and self.stop_checkpoint is None:
            self._stop_on_bad_steps(trainer, pl_module, bad)
        trajectories = step_output(outputs)["trajectories"]
        values.update(self._check_dynamics(trainer, pl_module, trajectories))
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        if self.stop_on_failed_rewards:
            self._stop_if_no_reward(trainer, trajectories)

    def _stop_if_no_reward(self, trainer: L.Trainer, trajectories: list[Trajectory]) -> None:
        """Raise ``NoRewardError`` when every fresh sample of this RL step (``trajectories``) had its reward fail."""
        if float(trainer.callback_metrics.get("train/phase_rl", 0.0)) < 1.0:
            return
        fresh = [t for t in trajectories if t.origin == "base"]
        if not fresh or not all(t.reward_error for t in fresh):
            return
        first = fresh[0]
        reason = first.env_error or (
            "the reward was not a finite number" + (" in [0, 1] (data.agent.reward_out_of_range: mask)" if first.reward_invalid else "")
        )
        datamodule = getattr(trainer, "datamodule", None)
        suite = getattr(datamodule, "suite", None)
        source = f"data.suite {suite.describe()}" if suite is not None and hasattr(suite, "describe") else "data.suite"
        self.stopped_on_failed_rewards = True
        raise NoRewardError(
            f"{source}: no reward could be computed for any of the {len(fresh)} samples of training step "
            f"{trainer.global_step} (reward/error_rate 1.0), so nothing can be trained; the first failure, task "
            f"{first.task_id!r}: {reason}. Fix the reward function or environment (a function that fails on some "
            "samples only is masked and counted; HealthWatchdog(stop_on_failed_rewards=false) under trainer.callbacks lets such a run go on)"
        )

    def _stop_on_bad_steps(self, trainer: L.Trainer, pl_module: L.LightningModule, bad: int) -> None:
        trainer.should_stop = True
        path = os.path.join(log_dir_of(trainer), "checkpoints", BAD_STEPS_CHECKPOINT)
        saved = ""
        if self.save_checkpoint_on_bad_steps:
            trainer.save_checkpoint(path)  # collective under DDP: every rank reaches this line
            self.stop_checkpoint = path
            saved = (
                f" The last good weights (the skipped steps changed nothing) are saved in {path}; "
                f"after fixing the cause, resume with --ckpt_path {path}."
            )
        else:
            self.stop_checkpoint = ""
        _print(
            f"[r3lightning] health: training stopped at global step {trainer.global_step} after {bad} consecutive "
            f"steps with non-finite loss or gradients (limit model.max_bad_steps={pl_module.max_bad_steps}; "
            f"{getattr(pl_module, 'skipped_steps', bad)} skipped in total, see train/skipped_steps).{saved} "
            "Usual causes: a learning rate too high, fp16 overflow, or bad data."
        )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_step = trainer.global_step
        self._resumed_from = str(trainer.ckpt_path) if trainer.ckpt_path else None

    def exception_save_plan(self, trainer: L.Trainer) -> tuple[str, str]:
        """What ``on_exception`` would write if training died now: ``(path, what)``, ``path`` empty when it
        writes nothing, ``what`` the clause that says so (``StepCheckpoint`` prints it on a second signal).

        One file per event: nothing is written when a checkpoint of this very step exists already (this
        run's ``last.ckpt``, or the checkpoint it resumed from when no step finished since), nor when no
        step was trained."""
        step = trainer.global_step
        if not self.save_checkpoint_on_exception:
            return "", "writing nothing (HealthWatchdog save_checkpoint_on_exception is off)"
        if trainer.world_size > 1:
            return "", "writing nothing (under several ranks no exception checkpoint is saved)"
        if trainer.state.fn != TrainerFn.FITTING or self.stop_checkpoint or self.stopped_on_failed_rewards:
            return "", "writing nothing"  # stopped for a reason of its own (nothing trained since the last checkpoint)
        same = same_step_checkpoint(trainer)
        if same:
            return "", f"writing nothing more: {same} holds global step {step} (resume with --ckpt_path {same})"
        resumed = getattr(self, "_resumed_from", None)
        if step == getattr(self, "_start_step", 0) and resumed and os.path.isfile(resumed):
            return "", f"writing nothing: no step finished since this run resumed from {resumed} (resume from it again)"
        if step == 0:
            return "", "writing nothing: no step has finished yet"
        path = os.path.join(log_dir_of(trainer), "checkpoints", EXCEPTION_CHECKPOINT)
        return path, f"saving {path} with the weights of global step {step} (resume with --ckpt_path {path})"

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Best-effort save of the weights trained so far when training dies (or is stopped by a second
        SIGTERM/SIGINT) in a single process, to ``<log_dir>/checkpoints/exception.ckpt``, unless a
        checkpoint of the same step exists already (``exception_save_plan``: one file per event). The
        step that was running is lost: a resume continues at the next batch. Under several ranks nothing
        is saved (saving is collective and the other ranks may be elsewhere)."""
        path, what = self.exception_save_plan(trainer)
        cause = getattr(exception, "signal_name", None) or type(exception).__name__
        if not path:
            if "holds global step" in what or "resumed from" in what:
                _print(f"[r3lightning] health: training stopped by {cause} at global step {trainer.global_step}; {what}.")
            return
        try:
            trainer.save_checkpoint(path)
        except Exception as err:  # never mask the original error
            _print(f"[r3lightning] health: could not save {path} after {cause}: {err}")
            return
        _print(
            f"[r3lightning] health: training stopped by {cause} at global step {trainer.global_step}; "
            f"the weights trained so far are saved in {path} (resume with --ckpt_path {path})."
        )

    # ---- dynamics warnings ------------------------------------------------------------------------
    def _check_dynamics(self, trainer: L.Trainer, pl_module: L.LightningModule, trajectories: list[Trajectory] = ()) -> dict[str, float]:
        metrics = trainer.callback_metrics
        if float(metrics.get("train/phase_rl", 0.0)) < 1.0:
            return {}
        for name in ("train/entropy", "rollout/response_len", "train/zero_variance_group_rate"):
            if name in metrics and math.isfinite(float(metrics[name])):
                self.history[name].append(float(metrics[name]))
        out: dict[str, float] = {}
        entropy = self._recent_mean("train/entropy")
        if entropy is not None:
            low = entropy < self.entropy_min
            high = entropy > self._entropy_max(pl_module)
            out["health/entropy_collapse"] = float(low)
            out["health/entropy_explosion"] = float(high)
            if low:
                self._warn(
                    "entropy_collapse",
                    f"policy entropy averaged {entropy:.4f} nats/token over the last {self.window} RL steps, below "
                    f"{self.entropy_min} (entropy collapse: the policy stopped exploring; consider a lower learning "
                    "rate, clip-higher (algorithm.clip_eps_high), or a KL/entropy regularizer).",
                )
            if high:
                self._warn(
                    "entropy_explosion",
                    f"policy entropy averaged {entropy:.3f} nats/token over the last {self.window} RL steps, above "
                    f"{self._entropy_max(pl_module):.3f} (close to uniform: training is diverging; lower the "
                    "learning rate or check the data).",
                )
        lengths = self.history["rollout/response_len"]
        if len(lengths) >= 2 * self.window:
            values = list(lengths)
            before = sum(values[: self.window]) / self.window
            after = sum(values[self.window :]) / self.window
            ratio = after / max(before, 1.0)
            out["health/response_len_growth"] = ratio
            if ratio >= self.length_growth_factor:
                self._warn(
                    "response_len_growth",
                    f"mean response length grew {ratio:.2f}x ({before:.1f} -> {after:.1f} tokens) between the last "
                    f"two windows of {self.window} RL steps (length blow-up: check rollout/truncated_rate, consider "
                    "algorithm.mask_truncated or a smaller sampling.max_new_tokens).",
                )
        zero_var = self._recent_mean("train/zero_variance_group_rate")
        if zero_var is not None:
            high = zero_var > self.zero_variance_max
            out["health/zero_variance_groups"] = float(high)
            if high:
                self._warn(
                    "zero_variance_groups",
                    f"{100 * zero_var:.0f}% of groups had identical rewards (no learning signal) over the last "
                    f"{self.window} RL steps, above {100 * self.zero_variance_max:.0f}% (tasks too easy or too hard "
                    "for the policy, or a collapsed policy; consider a larger group_size or other tasks).",
                )
        too_long = float(metrics.get("rollout/prompt_too_long_rate", 0.0))
        out["health/prompt_too_long"] = float(too_long > 0)
        if too_long > 0:
            limit = getattr(getattr(getattr(trainer, "datamodule", None), "agent", None), "max_context_tokens", "?")
            self._warn(
                "prompt_too_long",
                f"{100 * too_long:.0f}% of this step's episodes had a prompt longer than data.agent.max_context_tokens "
                f"({limit}); they ended before their first turn and train nothing (rollout/prompt_too_long_rate).",
            )
        errors = float(metrics.get("reward/error_rate", 0.0))
        out["health/reward_errors"] = float(errors > 0)
        if errors > 0:
            failed = next((t.env_error for t in trajectories if t.env_error), "")
            self._warn(
                "reward_errors",
                f"{100 * errors:.0f}% of this step's samples got no usable reward (the reward function or environment "
                "raised, timed out or returned no finite number); they are masked out of the loss (reward/error_rate; "
                "each error's text is in rollout_samples.jsonl's env_error)" + (f"; the first: {failed}" if failed else "") + ".",
            )
        if self.warned:
            out["health/warnings"] = float(len(self.warned))
        return out

    def _recent_mean(self, name: str) -> Optional[float]:
        values = list(self.history[name])[-self.window :]
        if len(values) < self.window:
            return None
        return sum(values) / len(values)

    def _entropy_max(self, pl_module: L.LightningModule) -> float:
        if self.entropy_max is not None:
            return self.entropy_max
        tokenizer = getattr(pl_module, "tokenizer", None)
        vocab = len(tokenizer) if tokenizer is not None else 0
        return self.entropy_max_fraction * math.log(vocab) if vocab > 1 else math.inf

    def _warn(self, kind: str, message: str) -> None:
        if kind in self.warned:
            return
        self.warned.add(kind)
        _print(f"[r3lightning] health warning ({kind}): {message}")

    # ---- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "warned": sorted(self.warned)}

    @staticmethod
    def check_state_dict(state: dict[str, Any]) -> None:
        """``ValueError("<field>: <problem>")`` for a damaged state (checked before any is restored)."""
        history = state.get("history", {})
        expect_type(history, dict, "history")
        for name, values in history.items():
            expect_type(values, list, f"history[{name!r}]")
            for value in values:
                expect_number(value, f"history[{name!r}]")
        expect_type(state.get("warned", []), list, "warned")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, values in state_dict.get("history", {}).items():
            self.history[name].extend(values)
        self.warned = set(state_dict.get("warned", []))


@rank_zero_only
def _print(message: str) -> None:
    print(message, flush=True)


def same_step_checkpoint(trainer: L.Trainer) -> str:
    """A checkpoint file a ``ModelCheckpoint`` of this run (``StepCheckpoint`` included) saved at the
    trainer's current global step and that still exists, or ""."""
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        if getattr(callback, "_last_global_step_saved", None) != trainer.global_step or trainer.global_step == 0:
            continue
        for path in (getattr(callback, "last_model_path", ""), getattr(callback, "_last_checkpoint_saved", "")):
            if path and os.path.isfile(path):
                return str(path)
    return ""
