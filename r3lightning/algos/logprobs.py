"""Log-probabilities and entropy from logits, without materializing a full log-softmax copy."""

from __future__ import annotations

from typing import Optional

import torch


MAX_LOGITS = 1 << 24
"""Logits taken at once on an accelerator by ``selective_log_softmax`` and ``entropy_from_logits``: 64 MB
in float32 (peak memory bounded, few kernel launches)."""

CPU_CHUNK_LOGITS = 1 << 19
"""Logits taken at once on the CPU: 2 MB in float32, so a chunk's several passes (float copy, max,
exp, sum, gather) run in cache instead of each streaming the whole chunk from memory."""


def default_chunk(logits: torch.Tensor) -> int:
    """Logits per chunk for ``logits``' device when the caller names none."""
    return CPU_CHUNK_LOGITS if logits.device.type == "cpu" else MAX_LOGITS


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits)[token] per position, and optionally the entropy, one chunk of positions at a time.

    Forward keeps only each position's log-sum-exp besides the logits; backward writes the gradient
    g * (onehot(token) - softmax) chunk by chunk into one tensor of the logits' dtype. The float
    operations are those autograd runs for ``gather(x) - logsumexp(x)`` on ``x = logits.float()``
    (``(x - lse).exp() * -g``, plus ``g`` at the token, cast to the logits' dtype), so values and
    gradients are the same bits, without the full-size zeros, scatter, sum and float copies autograd
    keeps for it.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, positions: int, with_entropy: bool):
        vocab = logits.shape[-1]
        flat, ids = logits.reshape(-1, vocab), token_ids.reshape(-1, 1)
        n = flat.shape[0]
        logp = torch.empty(n, device=logits.device)
        lse = torch.empty(n, device=logits.device)
        entropy = torch.empty(n, device=logits.device) if with_entropy else None
        for s in range(0, n, positions):
            x = flat[s : s + positions].float()
            chunk_lse = torch.logsumexp(x, dim=-1)
            lse[s : s + positions] = chunk_lse
            logp[s : s + positions] = x.gather(-1, ids[s : s + positions]).squeeze(-1) - chunk_lse
            if entropy is not None:
                entropy[s : s + positions] = _entropy(x)
        ctx.save_for_backward(logits, token_ids, lse)
        ctx.positions = positions
        if entropy is None:
            return logp.view(token_ids.shape), None
        entropy = entropy.view(token_ids.shape)
        ctx.mark_non_differentiable(entropy)
        return logp.view(token_ids.shape), entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        logits, token_ids, lse = ctx.saved_tensors
        vocab, positions = logits.shape[-1], ctx.positions
        flat, ids = logits.reshape(-1, vocab), token_ids.reshape(-1, 1)
        g = grad_logp.reshape(-1, 1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], positions):
            e = s + positions
            chunk = (flat[s:e].float() - lse[s:e, None]).exp_().mul_(-g[s:e])
            grad[s:e] = chunk.scatter_add_(-1, ids[s:e], g[s:e])
        return grad.view(logits.shape), None, None, None


def _entropy(x: torch.Tensor) -> torch.Tensor:
    """Entropy [n] of softmax over float32 logits ``x`` [n, V]."""
    log_p = torch.log_softmax(x, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def _positions_per_chunk(logits: torch.Tensor, max_logits: Optional[int]) -> int:
    return max((max_logits or default_chunk(logits)) // max(logits.shape[-1], 1), 1)


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor, max_logits: Optional[int] = None) -> torch.Tensor:
    """log softmax(logits)[..., token_ids], shape [B, T].

    logits: [B, T, V] (any float dtype; computed in float32 for stability).
    token_ids: [B, T] long.
    max_logits: logits per chunk (None: ``default_chunk``). Positions are taken a chunk at a time, so
    peak memory is one float32 chunk instead of [B, T, V]. Each position's result (and gradient) is the
    bits it would have alone: the reductions run along V, position by position, whatever the chunk.
    """
    return _TokenLogProbs.apply(logits, token_ids, _positions_per_chunk(logits, max_logits), False)[0]


def selective_log_softmax_and_entropy(
    logits: torch.Tensor, token_ids: torch.Tensor, max_logits: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``selective_log_softmax``, ``entropy_from_logits``) of the same logits [B, T, V], both [B, T], in one
    pass over them; the entropy carries no gradient. The same bits as the two functions apart."""
    return _TokenLogProbs.apply(logits, token_ids, _positions_per_chunk(logits, max_logits), True)


def entropy_from_logits(logits: torch.Tensor, max_logits: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits) per position, shape [B, T] from logits [B, T, V], positions in chunks of
    at most ``max_logits`` logits (as ``selective_log_softmax``)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    positions = _positions_per_chunk(logits, max_logits)
    chunks = [_entropy(chunk.float()) for chunk in flat.split(positions)]
    return (torch.cat(chunks) if chunks else flat.new_zeros(0, dtype=torch.float32)).view(logits.shape[:-1])


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
