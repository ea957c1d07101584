"""Rollout and batch statistics under the metric names of docs/monitoring.md."""

from __future__ import annotations

from collections import defaultdict

import torch

from r3lightning.algos.advantages import zero_variance_group_rate
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.types import ExperienceBatch, Group


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def trajectory_metrics(groups: list[Group]) -> dict[str, float]:
    """reward/*, rollout/* and train/zero_variance_group_rate for a list of RL groups."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not trajectories:
        return {}
    rewards = [t.reward for t in trajectories]
    mean = _mean(rewards)
    out = {
        "reward/mean": mean,
        "reward/std": _mean([(r - mean) ** 2 for r in rewards]) ** 0.5,
        "reward/success_rate": _mean([float(t.success) for t in trajectories]),
        "reward/error_rate": _mean([float(t.reward_error) for t in trajectories]),
        "reward/invalid_count": float(sum(t.reward_invalid for t in trajectories)),
        "reward/clipped_count": float(sum(t.reward_clipped for t in trajectories)),
        "rollout/response_len": _mean([float(t.num_response_tokens) for t in trajectories]),
        # Over the episodes that generated: rows that never played (prompt over the context) would pull the
        # mean down and read as "shorter answers".
        "rollout/response_len_generated": _mean([float(t.num_response_tokens) for t in trajectories if t.num_response_tokens]),
        "rollout/num_turns": _mean([float(t.num_messages) for t in trajectories]),
        "rollout/truncated_rate": _mean([float(t.truncated) for t in trajectories]),
        "rollout/invalid_action_rate": _mean(
            [t.invalid_actions / max(t.num_messages, 1) for t in trajectories]
        ),
        # Episodes with an action the environment refused (a math answer it could not read: no box, an
        # empty box).
        "rollout/rejected_action_rate": _mean([float(t.rejected_actions > 0) for t in trajectories]),
        "rollout/env_error_rate": _mean([float(t.end_reason == "env_error") for t in trajectories]),
        # Episodes whose first prompt did not fit in agent.max_context_tokens (no turn was played).
        "rollout/prompt_too_long_rate": _mean(
            [float(not t.turns and t.end_reason == "context_limit") for t in trajectories]
        ),
    }
    by_origin: dict[str, list[float]] = defaultdict(list)
    success_by_origin: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        by_origin[t.origin].append(t.reward)
        success_by_origin[t.origin].append(float(t.success))
    for origin, values in by_origin.items():
        out[f"reward/mean_{origin}"] = _mean(values)
        out[f"reward/success_rate_{origin}"] = _mean(success_by_origin[origin])
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    out["train/zero_variance_group_rate"] = zero_variance_group_rate(torch.tensor(rewards), group_index)
    return out


def experience_metrics(batch: ExperienceBatch) -> dict[str, float]:
    """Token counts of the batch that was trained on."""
    return {
        "train/rl_tokens": float(batch.loss_mask.sum()),
        "train/sft_tokens": float(batch.sft_mask.sum()),
        "train/sequences": float(len(batch)),
        "train/seq_len_max": float(batch.attention_mask.sum(-1).max()) if len(batch) else 0.0,
    }


def objective_activity(batch: ExperienceBatch, objective: AlgorithmConfig, max_reward: float) -> dict[str, float]:
    """How many rows of an RL step's batch each objective knob touched (``activity/*``, docs/monitoring.md):
    SFT rows (meta-tasks, reflections) and, with positive amplification, the successful RL rows it
    scales; with pivotal credit, the RL rows whose first loss token comes after their first response
    token (the pivot masked something)."""
    rl_rows = batch.loss_mask[:, 1:].sum(dim=1) > 0
    out = {"activity/sft_rows": float((batch.sft_mask[:, 1:].sum(dim=1) > 0).sum())}
    if objective.positive_amplification:
        out["activity/amplified_rows"] = float((rl_rows & (batch.rewards >= max_reward)).sum())
    if objective.pivotal_credit:
        response = batch.turn_index >= 0
        first_response = torch.where(response.any(dim=1), response.float().argmax(dim=1), torch.zeros_like(rl_rows, dtype=torch.long))
        first_loss = (batch.loss_mask > 0).float().argmax(dim=1)
        out["activity/pivot_masked_rows"] = float((rl_rows & (first_loss > first_response)).sum())
    return out
