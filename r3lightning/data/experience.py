"""The one experience path: an exploration in, the ExperienceBatch a step trains on out.

A pure function of its inputs (no Lightning, no model): rewards, group advantages (then an optional
adjustment hook, R³'s ranking bonus), of the RL trajectories (errored rewards excluded), positive amplification, the
masks (pivotal credit, truncation, SFT rows; meta-task samples as +1 RL rows when the objective says
so) and padding. Every method goes through it; the SFT
warm-start is an exploration with SFT samples only.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from r3lightning import algos
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.collate import collate_experience
from r3lightning.rollout.explorers.base import Exploration
from r3lightning.types import ExperienceBatch, Group, Trajectory

AdvantageAdjustment = Callable[[list[Group], torch.Tensor], torch.Tensor]
"""Maps the RL groups and their advantages [N] (group-major order, after the group estimator and
positive amplification) to adjusted advantages [N], e.g. R³'s ranking bonus for failed samples. It sees
the groups exactly as the explorer made them."""


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, valid: torch.Tensor, objective: AlgorithmConfig, max_reward: float
) -> torch.Tensor:
    """Per-trajectory advantages [N] from rewards [N], group ids [N] and a validity mask [N] (bool):
    invalid samples (errored rewards) take no part in their group's statistics and get advantage 0."""
    if rewards.numel() == 0:
        return rewards
    advantages = torch.zeros_like(rewards)
    if valid.any():
        advantages[valid] = algos.compute_advantages(
            rewards[valid], group_index[valid], objective.advantage, eps=objective.adv_eps, success_threshold=max_reward
        )
    if objective.positive_amplification:
        advantages = algos.positive_amplification(
            advantages, rewards, objective.alpha, max_reward, objective.max_reward_mode
        ) * valid
    return advantages


def make_experience(
    exploration: Exploration,
    objective: AlgorithmConfig,
    max_reward: float,
    pad_token_id: int,
    temperature: float = 1.0,
    adjust_advantages: Optional[AdvantageAdjustment] = None,
    replay_behaviour: str = "stored",
) -> tuple[ExperienceBatch, list[Trajectory]]:
    """(the padded batch, its trajectories in row order: the RL groups' members, then the SFT samples).

    temperature: the sampling temperature the RL rows were drawn at (the trainer scores them under it).
    adjust_advantages: optional hook applied to the group advantages (``AdvantageAdjustment``).
    replay_behaviour: how replayed rows are scored (``ExperienceBatch.behaviour``): ``stored`` (the
        ratio against the log-probs of the policy that sampled them) or ``pinned`` (as if on-policy).
    """
    groups = exploration.groups
    rl = [t for g in groups for t in g.trajectories]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    rewards = torch.tensor([t.reward for t in rl], dtype=torch.float32)
    valid = torch.tensor([not t.reward_error for t in rl], dtype=torch.bool)
    advantages = group_advantages(rewards, group_index, valid, objective, max_reward)
    if adjust_advantages is not None and rl:
        adjusted = adjust_advantages(groups, advantages)
        if adjusted.shape != advantages.shape:
            raise ValueError(f"advantage adjustment returned shape {tuple(adjusted.shape)} for {len(rl)} trajectories")
        advantages = adjusted * valid
    sft = list(exploration.sft)
    # The reference code trains meta-task samples as singleton groups of reward 1: advantage +1 in
    # the pooled RL loss. Demonstrations stay with the SFT head either way.
    as_positive = [objective.meta_tasks_as == "positive_samples" and t.origin != "demo" for t in sft]
    trajectories = rl + sft
    experience = collate_experience(
        trajectories,
        advantages.tolist() + [1.0 if positive else 0.0 for positive in as_positive],
        pad_token_id,
        pivotal_credit=objective.pivotal_credit,
        sft_rows=[False] * len(rl) + [not positive for positive in as_positive],
        replay_behaviour=replay_behaviour,
    )
    if objective.mask_truncated:
        truncated = torch.tensor([t.truncated for t in trajectories], dtype=torch.bool).unsqueeze(1)
        experience.loss_mask = experience.loss_mask.masked_fill(truncated, 0.0)
        experience.advantages = experience.advantages * experience.loss_mask
    experience.temperature = temperature
    return experience, trajectories
