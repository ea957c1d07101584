"""The decoding loop's choice of the next token and its behaviour log-probability (the ``hf`` engine's
eager and compiled decoding steps share it)."""

from __future__ import annotations

from typing import Optional

import torch

# inductor (torch 2.11, CUDA) fails to generate code for a cumsum over a large vocabulary (its split
# scan; seen on an H200 with 151,936 entries), so inside a compiled CUDA step the cumsums run eagerly
# behind a graph break. On the CPU inductor compiles them.
_eager_cumsum = torch.compiler.disable(torch.cumsum)


def _cumsum(x: torch.Tensor) -> torch.Tensor:
    return _eager_cumsum(x, dim=-1) if x.is_cuda and torch.compiler.is_compiling() else x.cumsum(dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    draw: Optional[torch.Tensor] = None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """One token per row [B] drawn from softmax(logits / temperature) [B, V], restricted to the
    ``top_k`` most likely tokens (0: all; a tie with the k-th stays), then to those at least ``min_p``
    times as likely as the row's most likely (0: all), then to the top-p nucleus (the most likely
    tokens until their mass reaches ``top_p``; the first one always stays).

    Inverse transform sampling: one uniform per row (``draw`` [B, 1], from ``torch.rand`` when None)
    against the cumulative probabilities. ``torch.multinomial`` (``generate``'s sampler) draws an
    exponential per vocabulary entry: an eighth of a rollout's time on CPU (docs/engines.md). Same
    distribution, another random stream; zero-probability tokens are never drawn (the search returns
    the first cumulative value above the draw).
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        probs = probs.masked_fill(probs < probs.topk(top_k, dim=-1).values[:, -1:], 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = _cumsum(sorted_probs) - sorted_probs
        # after top-k or min-p the nucleus is a share of the mass they left
        mass = top_p * sorted_probs.sum(dim=-1, keepdim=True) if top_k or min_p else top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(mass_before >= mass, 0.0))
    cumulative = _cumsum(probs)
    if draw is None:
        draw = torch.rand((logits.shape[0], 1), device=logits.device)
    return torch.searchsorted(cumulative, draw * cumulative[:, -1:], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


def next_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    draw: Optional[torch.Tensor] = None,
    top_k: int = 0,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token [B] and its behaviour log-prob [B] from float logits [B, V]: the arg max when
    ``temperature`` is 0 (log-prob of softmax(logits)), else ``sample_tokens`` (log-prob of
    softmax(logits / temperature), the distribution drawn from when no truncation is set, and the one
    the trainer recomputes)."""
    greedy = temperature <= 0.0
    token = logits.argmax(dim=-1) if greedy else sample_tokens(logits, temperature, top_p, draw, top_k, min_p)
    scale = 1.0 if greedy else temperature
    return token, torch.log_softmax(logits / scale, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
