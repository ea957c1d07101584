"""Group-relative advantages and R³L positive amplification.

Every estimator maps per-sequence rewards [N] plus a group index [N] to per-sequence advantages [N].
Groups may have different sizes (replayed or distilled trajectories join their group), so groups are
given by an index tensor rather than a [G, K] matrix.
"""

from __future__ import annotations

from typing import Literal

import torch

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "opmd", "reinforce", "raft")


def _group_sums(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, group_index, values)


def group_mean_std(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence group mean, unbiased group std (0 for singleton groups) and group size, each [N].

    rewards: [N] float; group_index: [N] long in [0, G).
    """
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    rewards = rewards.double()
    counts = _group_sums(torch.ones_like(rewards), group_index, num_groups)
    means = _group_sums(rewards, group_index, num_groups) / counts.clamp(min=1)
    centered = rewards - means[group_index]
    sq = _group_sums(centered**2, group_index, num_groups)
    var = torch.where(counts > 1, sq / (counts - 1).clamp(min=1), torch.zeros_like(sq))
    return means[group_index], var.sqrt()[group_index], counts[group_index]


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    estimator: str = "grpo",
    eps: float = 1e-6,
    success_threshold: float = 1.0,
) -> torch.Tensor:
    """Per-sequence advantages, shape [N].

    rewards: [N]; group_index: [N] long, sequences with equal index are normalized together.
    grpo:      (r - mean) / (std + eps), unbiased std as in TRL and verl.
    dr_grpo:   r - mean (Dr. GRPO drops the std division).
    rloo:      r - mean of the *other* members = K/(K-1) * (r - mean); 0 for singleton groups.
    opmd:      r - mean (the R³L reference code's estimator; same value as dr_grpo, kept as its own
               name so recipes say what they mean).
    reinforce: r, no baseline.
    raft:      1 for sequences with r >= success_threshold, else 0 (train on successes only).
    """
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must both be [N]")
    if rewards.numel() == 0:
        return rewards.float()
    mean, std, count = group_mean_std(rewards, group_index)
    r = rewards.double()
    if estimator == "grpo":
        adv = (r - mean) / (std + eps)
    elif estimator in ("dr_grpo", "opmd"):
        adv = r - mean
    elif estimator == "rloo":
        adv = torch.where(count > 1, (r - mean) * count / (count - 1).clamp(min=1), torch.zeros_like(r))
    elif estimator == "reinforce":
        adv = r
    elif estimator == "raft":
        adv = (r >= success_threshold).double()
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ADVANTAGE_ESTIMATORS}")
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def positive_amplification(
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    alpha: float = 3.0,
    max_reward: float = 1.0,
    max_reward_mode: Literal["alpha", "one"] = "alpha",
) -> torch.Tensor:
    """R³L positive amplification, shape [N] (docs/r3l.md).

    advantages, rewards: [N].
    R >= max_reward -> top = alpha (paper) or 1.0 (``max_reward_mode="one"``, the reference code);
    otherwise A > 0 -> min(alpha * A, top); else A unchanged.

    The cap is ours: the formula's intent is that a full success gets the largest value, but with
    z-scored advantages a lone partial success in a group of failures has A = 2.47 (8 samples), so
    alpha * A = 7.4 would outrank a full success's alpha = 3. Capped, a partial success never ranks
    above a full one, in either mode and under every estimator.
    """
    if max_reward_mode not in ("alpha", "one"):
        raise ValueError(f"max_reward_mode must be 'alpha' or 'one', got {max_reward_mode!r}")
    top_value = alpha if max_reward_mode == "alpha" else 1.0
    amplified = torch.where(advantages > 0, (alpha * advantages).clamp(max=top_value), advantages)
    return torch.where(rewards >= max_reward, torch.full_like(advantages, top_value), amplified)


def zero_variance_group_rate(rewards: torch.Tensor, group_index: torch.Tensor, tol: float = 1e-8) -> float:
    """Fraction of groups whose rewards all (nearly) agree: those give GRPO no gradient."""
    if rewards.numel() == 0:
        return 0.0
    num_groups = int(group_index.max().item()) + 1
    r = rewards.double()
    lo = torch.full((num_groups,), float("inf"), dtype=r.dtype).scatter_reduce(0, group_index, r, "amin")
    hi = torch.full((num_groups,), float("-inf"), dtype=r.dtype).scatter_reduce(0, group_index, r, "amax")
    present = _group_sums(torch.ones_like(r), group_index, num_groups) > 0
    flat = ((hi - lo) <= tol) & present
    return float(flat.sum().item() / max(int(present.sum().item()), 1))
