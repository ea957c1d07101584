"""Policy losses, the SFT loss and loss aggregation against global token counts.

Losses are returned per token ([B, T]); ``aggregate`` turns them into the micro-batch's share of the
global loss, so summing the micro-batch losses of every rank gives exactly the full-batch loss no
matter how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

POLICY_LOSSES: tuple[str, ...] = ("pg", "ppo_clip", "gspo")
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass
class PolicyLossOutput:
    """per_token: [B, T] loss; ratio: [B, T] importance ratio used (None for ``pg``);
    clipped: [B, T] bool, where the clipped branch was taken (None for ``pg``)."""

    per_token: torch.Tensor
    ratio: Optional[torch.Tensor] = None
    clipped: Optional[torch.Tensor] = None


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> PolicyLossOutput:
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    return PolicyLossOutput(per_token=-torch.minimum(unclipped, clipped), ratio=ratio.detach(), clipped=(clipped < unclipped).detach())


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "pg",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> PolicyLossOutput:
    """Per-token policy-gradient loss.

    logprobs: [B, T] current log-probs (with grad); old_logprobs: [B, T] behaviour log-probs;
    advantages: [B, T]; mask: [B, T] (only used by ``gspo`` to form the sequence ratio).
    pg:       -A · log π (no importance ratio; R³L's objective, exact on-policy).
    ppo_clip: -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A), r = π/π_old per token (eps_high > eps_low
              is DAPO's clip-higher).
    gspo:     the same clipped surrogate with the sequence ratio s = exp(mean_t log(π/π_old)) given to
              every token as sg(s)·π/sg(π), so each token's gradient is scaled by s (GSPO).
    """
    if kind == "pg":
        return PolicyLossOutput(per_token=-advantages * logprobs)
    if kind == "ppo_clip":
        ratio = torch.exp(logprobs - old_logprobs)
        return _clipped_surrogate(ratio, advantages, eps_low, eps_high)
    if kind == "gspo":
        mask = mask.to(logprobs.dtype)
        seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        seq_ratio = torch.exp(seq_log_ratio).detach().unsqueeze(-1)
        token_ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
        return _clipped_surrogate(token_ratio, advantages, eps_low, eps_high)
    raise ValueError(f"unknown policy loss {kind!r}; expected one of {POLICY_LOSSES}")


def shaped_off_policy_loss(logprobs: torch.Tensor, advantages: torch.Tensor, gamma: float = 0.1) -> torch.Tensor:
    """Critique-GRPO's policy shaping for off-policy refinements, per token [B, T].

    logprobs, advantages: [B, T]. Loss -A · π/(π + γ): the shaping f(π) = π/(π+γ) replaces the
    importance ratio, whose behaviour probability is unknown for text the policy did not sample, and
    boosts the gradient of low-probability tokens.
    """
    prob = logprobs.exp()
    return -advantages * prob / (prob + gamma)


def sft_nll(logprobs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token, [B, T] from log-probs [B, T]."""
    return -logprobs


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: float,
    global_sequences: float,
) -> torch.Tensor:
    """This micro-batch's share of the batch loss, a scalar.

    per_token, mask: [B, T]. global_tokens: number of mask tokens in the whole batch on all ranks;
    global_sequences: number of sequences with at least one mask token in the whole batch on all ranks.
    token_mean:          Σ mask·l / global_tokens (every token weighs the same).
    seq_mean_token_mean: Σ_seq (Σ_t mask·l / n_seq) / global_sequences (every sequence weighs the same).
    seq_mean_token_sum:  Σ_seq Σ_t mask·l / global_sequences (Dr. GRPO style, no length normalization).
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(global_tokens, 1.0)
    per_seq_tokens = mask.sum(-1)
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / per_seq_tokens.clamp(min=1)).sum() / max(global_sequences, 1.0)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(global_sequences, 1.0)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` [B, T] over ``mask`` [B, T]; 0 when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
