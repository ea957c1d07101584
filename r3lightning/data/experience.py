"""The one experience path: an exploration in, the ExperienceBatch a step trains on out.

A pure function of its inputs (no Lightning, no model): rewards, group advantages of the RL
trajectories (errored rewards excluded), positive amplification, the masks (pivotal credit,
truncation, SFT rows; meta-task samples as +1 RL rows when the objective says so) and padding. Every
method goes through it; the SFT warm-start is an exploration with SFT samples only. R³'s ranking
bonus is applied afterwards to the batch it returns (``data.failure_ranking.rank_failed_rows``), from
entropies the trainer computes on that batch's RL rows and the advantages kept here
(``ExperienceBatch.sequence_advantages``: computed once).
"""

from __future__ import annotations

import torch

from r3lightning import algos
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.collate import collate_experience
from r3lightning.data.step_rollout import StepRollout
from r3lightning.types import ExperienceBatch, Group, Trajectory


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


def rl_advantages(groups: list[Group], objective: AlgorithmConfig, max_reward: float) -> torch.Tensor:
    """Advantages [N] of the groups' trajectories in group-major order (``group_advantages``)."""
    rl = [t for g in groups for t in g.trajectories]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    rewards = torch.tensor([t.reward for t in rl], dtype=torch.float32)
    valid = torch.tensor([not t.reward_error for t in rl], dtype=torch.bool)
    return group_advantages(rewards, group_index, valid, objective, max_reward)


def make_experience(
    rollout: StepRollout, objective: AlgorithmConfig, pad_token_id: int
) -> tuple[ExperienceBatch, list[Trajectory]]:
    """(the padded batch, its trajectories in row order: the RL groups' members, then the SFT samples).

    The batch is scored at ``rollout.temperature``; replayed rows' behaviour is ``rollout.replay_behaviour``.
    """
    exploration = rollout.exploration
    rl = exploration.trajectories
    advantages = rl_advantages(exploration.groups, objective, rollout.max_reward)
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
        replay_behaviour=rollout.replay_behaviour,
    )
    if objective.mask_truncated:
        truncated = torch.tensor([t.truncated for t in trajectories], dtype=torch.bool).unsqueeze(1)
        experience.loss_mask = experience.loss_mask.masked_fill(truncated, 0.0)
        experience.advantages = experience.advantages * experience.loss_mask
    experience.temperature = rollout.temperature
    experience.sequence_advantages = torch.cat([advantages.float(), torch.tensor(
        [1.0 if positive else 0.0 for positive in as_positive], dtype=torch.float32)])
    return experience, trajectories
