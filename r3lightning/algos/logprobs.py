"""Log-probabilities and entropy from logits, without materializing a full log-softmax copy."""

from __future__ import annotations

import math

import torch


MAX_LOGITS = 1 << 24
"""Logits taken at once by ``selective_log_softmax`` and ``entropy_from_logits``: 64 MB in float32."""


def row_chunks(*tensors: torch.Tensor, max_logits: int) -> zip:
    """``tensors`` (sharing their first dim B; the first is logits [B, T, V]) split into chunks of whole
    rows holding at most ``max_logits`` logits each (at least one row per chunk)."""
    per_row = max(math.prod(tensors[0].shape[1:]), 1)
    rows = max(max_logits // per_row, 1)
    return zip(*(t.split(rows) for t in tensors))


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor, max_logits: int = MAX_LOGITS) -> torch.Tensor:
    """log softmax(logits)[..., token_ids], shape [B, T].

    logits: [B, T, V] (any float dtype; computed in float32 for stability).
    token_ids: [B, T] long.
    Several rows at a time, up to ``max_logits`` logits, so peak memory is one such float32 copy instead
    of [B, T, V]; a real vocabulary takes one row at a time. Each row's result (and gradient) is the
    bits it would have alone: the reductions run along V, row by row, whatever the chunk.
    """
    chunks = []
    for chunk_logits, chunk_ids in row_chunks(logits, token_ids, max_logits=max_logits):
        chunk_logits = chunk_logits.float()
        picked = chunk_logits.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1)
        chunks.append(picked - torch.logsumexp(chunk_logits, dim=-1))
    return torch.cat(chunks)


def entropy_from_logits(logits: torch.Tensor, max_logits: int = MAX_LOGITS) -> torch.Tensor:
    """Entropy of softmax(logits) per position, shape [B, T] from logits [B, T, V], rows in chunks of at
    most ``max_logits`` logits (as ``selective_log_softmax``)."""
    chunks = []
    for (chunk,) in row_chunks(logits, max_logits=max_logits):
        log_p = torch.log_softmax(chunk.float(), dim=-1)
        chunks.append(-(log_p.exp() * log_p).sum(dim=-1))
    return torch.cat(chunks)


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
