"""Training-dynamics monitoring: the metrics the module does not log itself, and rollout samples.

``R3LightningModule`` logs the per-step tags of docs/monitoring.md (losses, entropy, gradient norm,
ratios, rewards, rollout lengths, timings) from its own rank. ``TrainingDynamicsMonitor`` adds what
needs the whole batch or all ranks: k1/k3 estimates of the KL to the reference, token counts and
rewards summed over ranks (torchmetrics, synchronized when logged), the engine's weight version and
the wall time of a whole step, advantage statistics, the spread of response lengths and peak memory.
``RolloutSampleLogger`` writes a few complete trajectories through the logger (TensorBoard text, a W&B
table) and to ``<log_dir>/rollout_samples.jsonl`` so what the policy actually does can be read next to
the curves.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Any, Optional

import lightning as L
import torch
from torchmetrics import MeanMetric, SumMetric

from r3lightning.algos import kl_estimate
from r3lightning.callbacks.vllm_sync import VLLMWeightSync
from r3lightning.training.log_dir import log_dir_of  # noqa: F401 (the callbacks import it from here)
from r3lightning.types import Trajectory, step_output


class TrainingDynamicsMonitor(L.Callback):
    """Logs, every training step, the dynamics the module's own ``log_dict`` does not cover.

    Tags (docs/monitoring.md explains each):

    - ``train/kl_k1``, ``train/kl_k3``: k1 (log-ratio) and k3 (Schulman) estimates of
      KL(π_old ‖ π_ref) per loss token, on the sampled tokens, when the step has reference log-probs
      (``algorithm.kl_coef > 0`` in the RL phase). The module's ``train/kl_ref`` is the estimator the
      loss uses, on the current policy; these two are the same quantity by the two textbook estimators,
      so their disagreement shows the estimator's variance.
    - ``train/rl_tokens_all_ranks``, ``train/sft_tokens_all_ranks``: loss tokens of the step summed over
      ranks (the global count every loss is normalized by).
    - ``reward/mean_all_ranks``, ``reward/success_rate_all_ranks``: over every RL trajectory of every
      rank (only with more than one rank; with one they equal ``reward/mean`` and ``reward/success_rate``).
    - ``sync/weight_version``: optimizer steps in the weights the rollout engine holds, unless the
      ``VLLMWeightSync`` callback (which logs it) is on.
    - ``time/step_s``: wall time of the whole step (rollout, reward, update, callbacks before this one).
    - ``train/advantage_{mean,std,min,max}`` over this rank's RL loss tokens, and
      ``train/advantage_zero_share``: RL rows whose advantage is 0 on every loss token (no signal).
    - ``rollout/response_len_{std,min,max}``: the spread of generated tokens per RL trajectory
      (``rollout/response_len`` is the mean).
    - ``memory/peak_allocated_gb``: on CUDA, the most memory torch held during the step;
      ``memory/peak_rss_gb``: the process's peak resident memory so far (it never decreases).

    Cross-rank values are torchmetrics metrics updated with this rank's sums and computed (synchronized
    over ranks) when logged, then reset: per-step values, not running averages.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {
            "train/kl_k1": MeanMetric(),
            "train/kl_k3": MeanMetric(),
            "train/rl_tokens_all_ranks": SumMetric(),
            "train/sft_tokens_all_ranks": SumMetric(),
            "reward/mean_all_ranks": MeanMetric(),
            "reward/success_rate_all_ranks": MeanMetric(),
        }
        self._step_start: Optional[float] = None
        self._log_weight_version = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._log_weight_version = not any(isinstance(cb, VLLMWeightSync) for cb in trainer.callbacks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_start = time.perf_counter()
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for metric in self.metrics.values():
            # Here, not in setup: the strategy moves the module to its device after setup, and the
            # cross-rank reduction (NCCL) needs the metric states on that device.
            if metric.device != pl_module.device:
                metric.to(pl_module.device)
        values: dict[str, float] = {}
        step = step_output(outputs)
        experience = step["experience"]
        if experience is not None:
            values.update(advantage_stats(experience.advantages, experience.loss_mask))
            loss_mask = experience.loss_mask[:, 1:].float()
            rl_tokens = float(loss_mask.sum())
            values.update(self._sync("train/rl_tokens_all_ranks", rl_tokens))
            values.update(self._sync("train/sft_tokens_all_ranks", float(experience.sft_mask[:, 1:].sum())))
            if experience.ref_logprobs is not None:
                old = experience.old_logprobs[:, 1:].float()
                ref = experience.ref_logprobs[:, 1:].float()
                for estimator in ("k1", "k3"):
                    kl = kl_estimate(old, ref, estimator)
                    mean = float((kl * loss_mask).sum()) / max(rl_tokens, 1.0)
                    values.update(self._sync(f"train/kl_{estimator}", mean, weight=rl_tokens))
        if trainer.world_size > 1:
            rl = [t for t in step["trajectories"] if not t.is_sft]
            n = float(len(rl))
            reward = sum(t.reward for t in rl) / max(n, 1.0)
            success = sum(float(t.success) for t in rl) / max(n, 1.0)
            values.update(self._sync("reward/mean_all_ranks", reward, weight=n))
            values.update(self._sync("reward/success_rate_all_ranks", success, weight=n))
        rl_lengths = [t.num_response_tokens for t in step["trajectories"] if not t.is_sft]
        values.update(length_spread(rl_lengths))
        values.update(peak_memory_gb(pl_module.device))
        engine = getattr(pl_module, "engine", None)
        if self._log_weight_version and engine is not None:
            values["sync/weight_version"] = float(engine.weight_version)
        if self._step_start is not None:
            values["time/step_s"] = time.perf_counter() - self._step_start
        if values:
            pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    def _sync(self, name: str, value: float, weight: float = 1.0) -> dict[str, float]:
        """Update the metric with this rank's value, compute it over all ranks, reset it.

        Every rank calls this in the same order (the computation is collective). Returns nothing
        when no rank contributed (weight 0 everywhere), so an empty step logs no fake zero.
        """
        metric = self.metrics[name]
        # Python floats: torchmetrics creates them on the metric's device.
        if isinstance(metric, MeanMetric):
            metric.update(float(value), weight=float(weight))
        else:
            metric.update(float(value))
        result = float(metric.compute())
        metric.reset()
        return {name: result} if math.isfinite(result) else {}


def advantage_stats(advantages: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """``train/advantage_{mean,std,min,max}`` over the tokens where ``loss_mask`` is 1, and
    ``train/advantage_zero_share``: rows with loss tokens whose advantage is 0 on all of them, over rows
    with loss tokens. advantages, loss_mask: [B, T]. Empty when no token is an RL loss token (SFT steps).
    The std is the population std (divided by the token count)."""
    mask = loss_mask.bool()
    if not bool(mask.any()):
        return {}
    values = advantages[mask].float()
    rows = mask.any(dim=1)
    zero_rows = ((advantages.abs() * mask).sum(dim=1) == 0) & rows
    return {
        "train/advantage_mean": float(values.mean()),
        "train/advantage_std": float(values.std(unbiased=False)),
        "train/advantage_min": float(values.min()),
        "train/advantage_max": float(values.max()),
        "train/advantage_zero_share": float(zero_rows.sum()) / float(rows.sum()),
    }


def length_spread(lengths: list[int]) -> dict[str, float]:
    """``rollout/response_len_{std,min,max}`` of generated tokens per trajectory (population std); empty
    for no trajectory."""
    if not lengths:
        return {}
    mean = sum(lengths) / len(lengths)
    return {
        "rollout/response_len_std": (sum((n - mean) ** 2 for n in lengths) / len(lengths)) ** 0.5,
        "rollout/response_len_min": float(min(lengths)),
        "rollout/response_len_max": float(max(lengths)),
    }


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """``memory/peak_rss_gb``: the process's peak resident memory so far (Linux reports KiB, macOS bytes);
    on CUDA also ``memory/peak_allocated_gb``: the most torch allocated on ``device`` since the last
    ``torch.cuda.reset_peak_memory_stats``."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"memory/peak_rss_gb": peak / (2**30 if sys.platform == "darwin" else 2**20)}
    if device.type == "cuda":
        out["memory/peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


class RolloutSampleLogger(L.Callback):
    """Every ``every_n_steps`` optimizer steps, writes ``num_samples`` whole trajectories of the step.

    Each sample shows, turn by turn, the context tokens appended before the turn and the response,
    decoded with the policy's tokenizer (special tokens kept, so the chat template is visible), the
    parsed action and the environment's feedback, then reward, success, origin, pivot, end reason
    and text fields of ``Trajectory.info`` (reflections, guidance, errors). Samples are picked round
    robin over origins (base, distilled, reflection SFT, ...) so every kind of sample shows up.

    Written through every logger that shows text (rank 0): TensorBoard as text (tag
    ``samples/rollouts``), W&B as a table of the same name (``SAMPLE_COLUMNS``), and appended to
    ``<log_dir>/rollout_samples.jsonl`` (one JSON object per trajectory, with its ``step``; the place a
    CSV logger's run has them). Runs without a logger (``trainer.logger: false``) write nothing.

    Args:
        every_n_steps: log at global steps that are multiples of this (and at the first step).
        num_samples: trajectories per logged step.
        max_chars: longest text kept per field (longer text keeps its head and tail).
    """

    def __init__(self, every_n_steps: int = 50, num_samples: int = 4, max_chars: int = 4000) -> None:
        if every_n_steps < 1 or num_samples < 1:
            raise ValueError(f"RolloutSampleLogger: every_n_steps ({every_n_steps}) and num_samples ({num_samples}) must be >= 1")
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.max_chars = max_chars
        self._last_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._last_step or not trainer.loggers:
            return  # without a logger (logger: false) there is no run directory to write to
        if step % self.every_n_steps != 0 and self._last_step >= 0:
            return
        trajectories = list(step_output(outputs)["trajectories"])
        if not trajectories:
            return
        self._last_step = step
        records = [self.record(t, pl_module.tokenizer, step) for t in pick_samples(trajectories, self.num_samples)]
        log_dir = log_dir_of(trainer)
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, "rollout_samples.jsonl"), "a") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
        text = "\n\n---\n\n".join(render_markdown(r) for r in records)
        for logger in trainer.loggers:
            if hasattr(logger, "log_table"):  # W&B: one row per sample
                logger.log_table("samples/rollouts", columns=list(SAMPLE_COLUMNS), data=[sample_row(r) for r in records], step=step)
                continue
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):  # TensorBoard's Text tab
                experiment.add_text("samples/rollouts", text, global_step=step)

    def record(self, trajectory: Trajectory, tokenizer, step: int) -> dict[str, Any]:
        """A JSON-ready description of one trajectory (texts decoded, long texts shortened)."""
        turns = []
        for turn in trajectory.turns:
            turns.append(
                {
                    "context": self._clip(tokenizer.decode(turn.context_ids, skip_special_tokens=False)),
                    "response": self._clip(tokenizer.decode(turn.response_ids, skip_special_tokens=False)),
                    "action": self._clip(turn.action),
                    "feedback": self._clip(turn.feedback),
                    "response_tokens": len(turn.response_ids),
                    "trainable": turn.trainable,
                }
            )
        return {
            "step": step,
            "task_id": trajectory.task_id,
            "origin": trajectory.origin,
            "reward": trajectory.reward,
            "success": trajectory.success,
            "truncated": trajectory.truncated,
            "reward_error": trajectory.reward_error,
            "pivot": trajectory.pivot,
            "model_version": trajectory.model_version,
            "end_reason": trajectory.end_reason,
            "invalid_actions": trajectory.invalid_actions,
            "rejected_actions": trajectory.rejected_actions,
            "env_error": trajectory.env_error,
            "info": {k: self._info_value(v) for k, v in trajectory.info.items() if self._info_value(v) is not None},
            "turns": turns,
        }

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_chars:
            return text
        half = self.max_chars // 2
        return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"

    def _info_value(self, value: Any) -> Any:
        """Text and numbers of ``Trajectory.info`` (reflections, guidance, errors); token-id lists are left out."""
        if isinstance(value, str):
            return self._clip(value)
        if isinstance(value, (bool, int, float)) or value is None:
            return value
        if isinstance(value, dict):
            kept = {str(k): self._info_value(v) for k, v in value.items()}
            return {k: v for k, v in kept.items() if v is not None} or None
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            return [self._clip(v) for v in value]
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self._last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step = int(state_dict.get("last_step", -1))


SAMPLE_COLUMNS = ("step", "task_id", "origin", "reward", "success", "end_reason", "sample")
"""Columns of the W&B table of samples; ``sample`` is the Markdown TensorBoard shows."""


def sample_row(record: dict[str, Any]) -> list[Any]:
    """One sample (``RolloutSampleLogger.record``) as a row of ``SAMPLE_COLUMNS``."""
    return [*(record[c] for c in SAMPLE_COLUMNS[:-1]), render_markdown(record)]


def pick_samples(trajectories: list[Trajectory], n: int) -> list[Trajectory]:
    """Up to ``n`` trajectories, round robin over origins in order of first appearance."""
    by_origin: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_origin.setdefault(t.origin, []).append(t)
    picked: list[Trajectory] = []
    queues = list(by_origin.values())
    while len(picked) < n and any(queues):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


def render_markdown(record: dict[str, Any]) -> str:
    """One sample as Markdown for TensorBoard's text plugin (texts in code blocks, shown verbatim)."""
    head = (
        f"**{record['task_id']}** · origin `{record['origin']}` · reward {record['reward']:.3g} · "
        f"success {record['success']} · truncated {record['truncated']} · pivot {record['pivot']} · "
        f"model version {record['model_version']}"
    )
    if record["reward_error"]:
        head += " · **reward error**"
    lines = [head, ""]
    for i, turn in enumerate(record["turns"]):
        lines += [f"turn {i} context:", _block(turn["context"]), f"turn {i} response ({turn['response_tokens']} tokens):", _block(turn["response"])]
        if turn["feedback"]:
            lines += [f"turn {i} feedback:", _block(turn["feedback"])]
    if record["info"]:
        lines += ["info:", _block(json.dumps(record["info"], indent=1))]
    return "\n\n".join(lines)


def _block(text: str) -> str:
    return "```\n" + text.replace("```", "``\u200b`") + "\n```"
