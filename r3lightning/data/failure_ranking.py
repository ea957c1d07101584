"""R³'s ranking of a step's failed samples, from the entropies the trainer computed (``algos.ranking``).

The module scores the per-token entropies of the collated batch's RL rows with its own forward pass and
hands them here; this turns them into the batch's adjusted advantages and the activity figures that
show the ranking acted (docs/monitoring.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from r3lightning import algos
from r3lightning.algos.objective import AlgorithmConfig, RankingConfig
from r3lightning.types import ExperienceBatch, Group, Trajectory


@dataclass
class RankingActivity:
    """What the ranking did in one step.

    ranked: failed samples that generated tokens, in groups with at least two of them (the ones whose
        bonus can differ from 0).
    capped: failed samples whose advantage the cap at the step's lowest success advantage lowered.
    bonus_abs_mean: mean |bonus| over the ranked samples.
    length_corr: correlation of the bonus with response length (centred in each group) over the ranked
        samples; near ±1 means the ranking is a function of length. NaN with fewer than 3 ranked samples
        or no spread.
    credit_corr: the premise gate: correlation of the bonus with the failures' partial credit (how
        close each came to the reference, ``Trajectory.partial_credit``; centred in each group) over the
        ranked samples that have one. Positive: the ranking pays failures that came closer, the
        premise of rewarding them; near 0: it orders them no better than chance. NaN with fewer than 3
        such samples or no spread.
    credit_samples: ranked samples with a partial credit (the gate's sample size).
    """

    ranked: int = 0
    capped: int = 0
    bonus_abs_mean: float = 0.0
    length_corr: float = float("nan")
    credit_corr: float = float("nan")
    credit_samples: int = 0

    def metrics(self) -> dict[str, float]:
        figures = {
            "activity/ranked_failures": float(self.ranked),
            "activity/ranking_capped": float(self.capped),
            "activity/ranking_bonus_abs_mean": self.bonus_abs_mean,
            "activity/ranking_credit_samples": float(self.credit_samples),
        }
        if not math.isnan(self.length_corr):
            figures["activity/ranking_length_corr"] = self.length_corr
        if not math.isnan(self.credit_corr):
            figures["activity/ranking_credit_corr"] = self.credit_corr
        return figures


def failure_tier(trajectory: Trajectory) -> int:
    """1 for a failure whose answer the environment could read (a wrong answer in the right format),
    0 for one with a malformed or rejected action. Truncation does not change it: an unreadable answer
    cut at the length cap is not lifted above an unreadable one that stopped."""
    return int(trajectory.invalid_actions == 0 and trajectory.rejected_actions == 0)


def _centred_correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() < 3:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    denominator = float(x.norm() * y.norm())
    return float((x * y).sum()) / denominator if denominator > 0 else float("nan")


def failure_order(
    entropy: torch.Tensor, response_mask: torch.Tensor, peers: torch.Tensor, cfg: RankingConfig,
    generator: Optional[torch.Generator],
) -> torch.Tensor:
    """[N, N] pairwise order of the ranked rows by ``cfg.order``: R³'s entropy score, a random order
    (``placebo``, from ``generator``) or shorter-first (``length``)."""
    if cfg.order == "entropy":
        return algos.pairwise_entropy_order(
            entropy, response_mask, peers, cfg.top_k, cfg.window, cfg.weight_local, cfg.weight_global
        )
    if cfg.order == "placebo":
        if generator is None:
            raise ValueError("model.algorithm.ranking.order 'placebo' needs a generator (the step's random order)")
        draw = torch.rand(peers.shape[0], generator=generator, dtype=torch.float64)
        return algos.order_from_scores(draw, peers)
    return algos.order_from_scores(-response_mask.sum(dim=1).double(), peers)


def rank_failures(
    groups: list[Group],
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RankingConfig,
    max_reward: float,
    generator: Optional[torch.Generator] = None,
    ceiling: Optional[float] = None,
) -> tuple[torch.Tensor, RankingActivity]:
    """(advantages [N] with the failures' ranking bonus, what the ranking did).

    groups: the step's RL groups, whose trajectories in group-major order are the N rows;
    advantages: [N] after the group estimator; entropy: [N, T-1] per-prediction entropy; response_mask:
    [N, T-1], 1 where the prediction's target is a response token (``turn_index[:, 1:] >= 0``);
    generator: the step's random order for ``order: placebo``; ceiling: the step's lowest success
    advantage over every rank (None: over these rows, ``algos.lowest_success_advantage``).
    Ranked: failures (reward below ``max_reward``, reward not errored) with at least one response token.
    """
    rl = [t for g in groups for t in g.trajectories]
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    entropy, response_mask = entropy.cpu(), response_mask.cpu()
    advantages_cpu = advantages.cpu()
    lengths = response_mask.sum(dim=1).double()
    success = torch.tensor([t.reward >= max_reward for t in rl], dtype=torch.bool)
    ranked = torch.tensor([t.reward < max_reward and not t.reward_error for t in rl], dtype=torch.bool) & (lengths > 0)
    tier = torch.tensor([failure_tier(t) for t in rl], dtype=torch.long)
    peers = algos.ranking_peers(ranked, group_index)
    order = failure_order(entropy, response_mask, peers, cfg, generator)
    bonus = algos.ranking_bonus(order, tier, ranked, group_index, cfg.delta)
    if ceiling is None:
        ceiling = algos.lowest_success_advantage(advantages_cpu, success)
    adjusted, capped = algos.add_failure_bonus(advantages_cpu, bonus.to(advantages_cpu.dtype), success, ceiling)
    in_ranked_group = ranked & (torch.bincount(group_index[ranked], minlength=len(groups))[group_index] > 1)
    centred_length = lengths - _group_mean(lengths, in_ranked_group, group_index, len(groups))
    credit = torch.tensor([math.nan if t.partial_credit is None else t.partial_credit for t in rl], dtype=torch.float64)
    with_credit = in_ranked_group & ~torch.isnan(credit)
    with_credit = with_credit & (torch.bincount(group_index[with_credit], minlength=len(groups))[group_index] > 1)
    credit = torch.nan_to_num(credit)
    centred_credit = credit - _group_mean(credit, with_credit, group_index, len(groups))
    centred_bonus = bonus.double() - _group_mean(bonus.double(), with_credit, group_index, len(groups))
    activity = RankingActivity(
        ranked=int(in_ranked_group.sum()),
        capped=int(capped.sum()),
        bonus_abs_mean=float(bonus[in_ranked_group].abs().mean()) if in_ranked_group.any() else 0.0,
        length_corr=_centred_correlation(bonus[in_ranked_group].double(), centred_length[in_ranked_group]),
        credit_corr=_centred_correlation(centred_bonus[with_credit], centred_credit[with_credit]),
        credit_samples=int(with_credit.sum()),
    )
    return adjusted.to(advantages.device), activity


def rank_failed_rows(
    experience: ExperienceBatch,
    groups: list[Group],
    entropy: torch.Tensor,
    objective: AlgorithmConfig,
    max_reward: float,
    generator: Optional[torch.Generator] = None,
    ceiling: Optional[float] = None,
) -> RankingActivity:
    """Give the failed RL rows of ``experience`` (``make_experience``'s batch of ``groups``: their N
    trajectories are its first N rows) their ranking bonus, in place; returns what the ranking did.

    The advantages are the batch's own (``experience.sequence_advantages``, computed once by
    ``make_experience``); ``objective.ranking`` says how to rank. entropy: [N, T'-1] per-prediction
    entropy of those rows as ``experience.slice(0, N)`` trims them; generator, ceiling: as
    ``rank_failures``.
    """
    rl = [t for g in groups for t in g.trajectories]
    if experience.sequence_advantages is None:
        raise ValueError("rank_failed_rows needs the batch's sequence_advantages (a batch from make_experience)")
    rows = experience.slice(0, len(rl))
    response = (rows.turn_index[:, 1:] >= 0).float()
    advantages = experience.sequence_advantages[: len(rl)]
    adjusted, activity = rank_failures(
        groups, advantages, entropy, response, objective.ranking, max_reward, generator, ceiling
    )
    valid = torch.tensor([not t.reward_error for t in rl], dtype=torch.bool, device=adjusted.device)
    adjusted = adjusted * valid
    experience.sequence_advantages[: len(rl)] = adjusted
    experience.advantages[: len(rl)] = adjusted.unsqueeze(1) * experience.loss_mask[: len(rl)]
    return activity


def _group_mean(values: torch.Tensor, rows: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-row mean of ``values`` over the ``rows`` of its group, shape [N] (0 for groups without any)."""
    total = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, group_index, torch.where(rows, values, 0.0))
    count = torch.bincount(group_index[rows], minlength=num_groups).to(values.dtype)
    return (total / count.clamp(min=1))[group_index]
