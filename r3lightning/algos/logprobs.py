"""Log-probabilities and entropy from logits, without materializing a full log-softmax copy."""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[..., token_ids], shape [B, T].

    logits: [B, T, V] (any float dtype; computed in float32 for stability).
    token_ids: [B, T] long.
    Row by row so peak memory is one [T, V] float32 copy instead of [B, T, V].
    """
    rows = []
    for row_logits, row_ids in zip(logits, token_ids):
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, shape [B, T] from logits [B, T, V]."""
    rows = []
    for row_logits in logits:
        log_p = torch.log_softmax(row_logits.float(), dim=-1)
        rows.append(-(log_p.exp() * log_p).sum(dim=-1))
    return torch.stack(rows)


def scored_window_start(scored: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading next-token predictions of a right-padded batch no loss reads.

    scored: [B, T] bool, True at the tokens a loss scores (RL or SFT mask); attention_mask: [B, T], each
    row's tokens first, then padding. Prediction t (0 <= t <= T-2) scores token t + 1. Returns the first
    prediction any row scores, capped at the shortest row's length - 1 so that every row's first
    ``start`` tokens are real ones (a shared prefix); 0 when nothing can be skipped.
    """
    if scored.shape[1] < 2:
        return 0
    later = scored[:, 1:]
    first = torch.where(later.any(dim=1), later.int().argmax(dim=1), later.shape[1])
    shortest = int(attention_mask.sum(dim=1).min())
    return max(0, min(int(first.min()), shortest - 1))


def shift_logits_and_labels(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align next-token predictions with the tokens they predict.

    logits: [B, T, V] from a causal LM on input_ids [B, T].
    Returns (logits[:, :-1], input_ids[:, 1:]): position t of the result scores token t+1.
    """
    return logits[:, :-1], input_ids[:, 1:]
