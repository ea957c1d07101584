"""R³'s ranking of a step's failed samples, from the entropies the trainer computed (``algos.ranking``).

The module scores the per-token entropies of the collated batch's RL rows with its own forward pass and
hands them here; this turns them into the batch's adjusted advantages and the activity figures that
show the ranking acted (docs/monitoring.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from r3lightning import algos
from r3lightning.algos.objective import AlgorithmConfig, RankingConfig
from r3lightning.data.experience import rl_advantages
from r3lightning.types import ExperienceBatch, Group, Trajectory


@dataclass
class RankingActivity:
    """What the ranking did in one step.

    ranked: failed samples that generated tokens, in groups with at least two of them (the ones whose
        bonus can differ from 0).
    capped: failed samples whose advantage the cap at their group's lowest success advantage lowered.
    bonus_abs_mean: mean |bonus| over the ranked samples.
    length_corr: correlation of the bonus with response length (centred in each group) over the ranked
        samples; near ±1 means the ranking is a function of length. NaN with fewer than 3 ranked samples
        or no spread.
    """

    ranked: int = 0
    capped: int = 0
    bonus_abs_mean: float = 0.0
    length_corr: float = float("nan")

    def metrics(self) -> dict[str, float]:
        figures = {
            "activity/ranked_failures": float(self.ranked),
            "activity/ranking_capped": float(self.capped),
            "activity/ranking_bonus_abs_mean": self.bonus_abs_mean,
        }
        if not math.isnan(self.length_corr):
            figures["activity/ranking_length_corr"] = self.length_corr
        return figures


def failure_tier(trajectory: Trajectory) -> int:
    """1 for a truncated or well-formed failure (an answer the environment could read), 0 for one whose
    action was malformed or rejected: the seed ranks "truncated or failed samples", a readable wrong
    answer ahead of no answer."""
    return int(trajectory.truncated or (trajectory.invalid_actions == 0 and trajectory.rejected_actions == 0))


def _centred_correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() < 3:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")


def rank_failures(
    groups: list[Group],
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RankingConfig,
    max_reward: float,
) -> tuple[torch.Tensor, RankingActivity]:
    """(advantages [N] with the failures' ranking bonus, what the ranking did).

    groups: the step's RL groups, whose trajectories in group-major order are the N rows;
    advantages: [N] after the group estimator; entropy: [N, T-1] per-prediction entropy; response_mask:
    [N, T-1], 1 where the prediction's target is a response token (``turn_index[:, 1:] >= 0``).
    Ranked: failures (reward below ``max_reward``, reward not errored) with at least one response token.
    """
    rl = [t for g in groups for t in g.trajectories]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    lengths = response_mask.sum(dim=1).double()
    success = torch.tensor([t.reward >= max_reward for t in rl])
    ranked = torch.tensor([t.reward < max_reward and not t.reward_error for t in rl]) & (lengths > 0)
    tier = torch.tensor([failure_tier(t) for t in rl], dtype=torch.long)
    local = algos.local_exploration_score(entropy, response_mask, cfg.top_k)
    stability = algos.global_stability_score(entropy, response_mask, cfg.window)
    scores = algos.structural_entropy_score(local, stability, ranked, group_index, cfg.weight_local, cfg.weight_global)
    bonus = algos.ranking_bonus(scores, tier, ranked, group_index, cfg.delta)
    adjusted, capped = algos.add_failure_bonus(advantages, bonus.to(advantages.dtype), success, group_index)
    in_ranked_group = ranked & (torch.bincount(group_index[ranked], minlength=len(groups))[group_index] > 1)
    centred_length = lengths - _group_mean(lengths, in_ranked_group, group_index, len(groups))
    activity = RankingActivity(
        ranked=int(in_ranked_group.sum()),
        capped=int(capped.sum()),
        bonus_abs_mean=float(bonus[in_ranked_group].abs().mean()) if in_ranked_group.any() else 0.0,
        length_corr=_centred_correlation(bonus[in_ranked_group].double(), centred_length[in_ranked_group]),
    )
    return adjusted, activity


def rank_failed_rows(
    experience: ExperienceBatch, groups: list[Group], entropy: torch.Tensor, objective: AlgorithmConfig, max_reward: float
) -> RankingActivity:
    """Give the failed RL rows of ``experience`` (``make_experience``'s batch of ``groups``: their N
    trajectories are its first N rows) their ranking bonus, in place; returns what the ranking did.

    entropy: [N, T'-1] per-prediction entropy of those rows as ``experience.slice(0, N)`` trims them.
    """
    rl = [t for g in groups for t in g.trajectories]
    rows = experience.slice(0, len(rl))
    response = (rows.turn_index[:, 1:] >= 0).float()
    advantages = rl_advantages(groups, objective, max_reward)
    adjusted, activity = rank_failures(groups, advantages, entropy, response, objective.ranking, max_reward)
    valid = torch.tensor([not t.reward_error for t in rl], dtype=torch.bool)
    experience.advantages[: len(rl)] = (adjusted * valid).unsqueeze(1) * experience.loss_mask[: len(rl)]
    return activity


def _group_mean(values: torch.Tensor, rows: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-row mean of ``values`` over the ``rows`` of its group, shape [N] (0 for groups without any)."""
    total = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, group_index, torch.where(rows, values, 0.0))
    count = torch.bincount(group_index[rows], minlength=num_groups).to(values.dtype)
    return (total / count.clamp(min=1))[group_index]
