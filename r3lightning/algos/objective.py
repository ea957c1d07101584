"""The RL objective as one typed config: a composition of orthogonal knobs (docs/algorithms.md).

Every ``configs/algorithms/*.yaml`` preset sets every field in ``METHOD_FIELDS`` (and its explorer),
so stacking a preset on any recipe gives exactly that method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class RankingConfig:
    """R³'s structural-entropy ranking of failed samples (``algos.ranking``, docs/r3.md).

    Args:
        enabled: give the failed samples that generated a centred bonus, ordered by the structure of
            their token entropies, added to their advantage after the group estimator (one extra
            no-grad forward pass per step).
        top_k: number of a response's most uncertain tokens in the local-exploration score (a fixed
            count, so the score does not step with response length).
        window: tokens per window of the global-stability score; a response needs two windows to have
            one, so ``2 · window`` must fit ``data.sampling.max_new_tokens`` (checked at setup).
        weight_local: weight of the local-exploration score.
        weight_global: weight of the global-stability score.
        delta: spread of the bonus in advantage units: the best-ranked failure of a group gets
            ``+delta/2``, the worst ``-delta/2``.
        order: what orders failures of one tier: ``entropy`` (R³'s structural-entropy score), or a
            control that keeps everything else (tiers, bonus, cap): ``placebo`` (a random order, drawn
            per step from the rollout seed) or ``length`` (shorter first). R³ against each control
            tells whether the entropy score carries more than chance or length (presets
            ``r3_ranking_placebo``, ``r3_ranking_length``).
    """

    enabled: bool = False
    top_k: int = 2
    window: int = 8
    weight_local: float = 1.0
    weight_global: float = 1.0
    delta: float = 0.2
    order: Literal["entropy", "placebo", "length"] = "entropy"

    def __post_init__(self) -> None:
        if self.order not in ("entropy", "placebo", "length"):
            raise ValueError(f"model.algorithm.ranking.order must be entropy, placebo or length, got {self.order!r}")
        if self.top_k < 1 or self.window < 1:
            raise ValueError(f"model.algorithm.ranking: top_k ({self.top_k}) and window ({self.window}) must be >= 1")
        if self.delta < 0:
            raise ValueError(f"model.algorithm.ranking.delta must be >= 0, got {self.delta}")


@dataclass
class AlgorithmConfig:
    """The RL objective: a composition of orthogonal knobs (docs/algorithms.md).

    Args:
        advantage: group estimator: grpo | dr_grpo | rloo | opmd | reinforce | raft.
        adv_eps: epsilon added to the group std (grpo).
        positive_amplification: R³L positive amplification of positive advantages.
        alpha: amplification factor.
        max_reward_mode: value given to max-reward samples (reward >= ``data.max_reward``): ``alpha``
            (paper) or ``one`` (reference code).
        pivotal_credit: mask turns before each trajectory's pivot (R³L); off = trajectory-level credit.
            Needs an explorer that sets pivots (``reflect_retry`` with retries).
        policy_loss: pg (no ratio) | ppo_clip | gspo.
        clip_eps_low: lower clip range of the ratio.
        clip_eps_high: upper clip range of the ratio (> low is DAPO's clip-higher).
        kl_coef: weight of the KL penalty to the frozen reference: the policy as RL starts (after the
            SFT warm-start, if any). 0 disables the reference model.
        kl_estimator: k1 | k2 | k3.
        aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum.
        sft_weight: weight of the SFT head's NLL during RL (meta-tasks, GNT reflections; 0: none); the
            warm-start's demonstrations always weigh 1.
        sft_aggregation: token_mean (every SFT token weighs the same) | seq_mean_token_mean (every SFT
            sample weighs the same, so a few long reflections do not drown many short action turns).
        meta_tasks_as: how RL-phase meta-task samples (R³L's reflect and retry samples) are trained:
            ``sft_head`` (the paper's L_RL + sft_weight · L_SFT, normalized separately) or
            ``positive_samples`` (the reference code: singleton groups with advantage +1 inside the
            pooled RL loss; needs ``policy_loss: pg`` or ``recompute_old_logprobs``, since scripted and
            reflection samples have no behaviour log-probs).
        off_policy_gamma: γ of Critique-GRPO's policy shaping π/(π+γ) on off-policy refinements; null
            unless the explorer makes off-policy samples (``critique_refine``), which need it.
        recompute_old_logprobs: recompute behaviour log-probs with the trainer before updating (needed
            for ratios when the engine's numerics differ from the trainer's, or for replayed samples).
        update_epochs: passes over each batch (more than 1 makes the importance ratio move away from 1).
        mask_truncated: give truncated samples no RL loss (overlong filtering).
        ranking: R³'s structural-entropy ranking reward for failed samples (``RankingConfig``).
    """

    advantage: Literal["grpo", "dr_grpo", "rloo", "opmd", "reinforce", "raft"] = "grpo"
    adv_eps: float = 1e-6
    positive_amplification: bool = False
    alpha: float = 3.0
    max_reward_mode: Literal["alpha", "one"] = "alpha"
    pivotal_credit: bool = False
    policy_loss: Literal["pg", "ppo_clip", "gspo"] = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    sft_weight: float = 0.0
    sft_aggregation: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    meta_tasks_as: Literal["sft_head", "positive_samples"] = "sft_head"
    off_policy_gamma: Optional[float] = None
    recompute_old_logprobs: bool = False
    update_epochs: int = 1
    mask_truncated: bool = False
    ranking: RankingConfig = field(default_factory=RankingConfig)


METHOD_FIELDS: tuple[str, ...] = (
    "advantage",
    "positive_amplification",
    "alpha",
    "max_reward_mode",
    "pivotal_credit",
    "policy_loss",
    "clip_eps_low",
    "clip_eps_high",
    "kl_coef",
    "kl_estimator",
    "aggregation",
    "sft_weight",
    "sft_aggregation",
    "meta_tasks_as",
    "off_policy_gamma",
    "recompute_old_logprobs",
    "ranking",
)
"""The fields that define a method; every preset sets all of them (tested). The others (``adv_eps``,
``update_epochs``, ``mask_truncated``) are numerics a recipe may tune."""
