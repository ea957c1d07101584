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


def shift_logits_and_labels(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align next-token predictions with the tokens they predict.

    logits: [B, T, V] from a causal LM on input_ids [B, T].
    Returns (logits[:, :-1], input_ids[:, 1:]): position t of the result scores token t+1.
    """
    return logits[:, :-1], input_ids[:, 1:]
