"""Loss masks derived from per-token turn indices."""

from __future__ import annotations

import torch


def pivotal_mask(turn_index: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """R³L pivotal credit: keep only assistant tokens of turns at or after the pivot, shape [B, T] bool.

    turn_index: [B, T] long, the turn (or reasoning step) that generated each token, -1 on tokens that
        no turn generated (prompt, observations, padding).
    pivot: [B] long, the first turn that diverges from the partner trajectory; values <= 0 mean "no
        shared prefix" and keep every assistant token.
    """
    if turn_index.dim() != 2 or pivot.shape != turn_index.shape[:1]:
        raise ValueError(f"turn_index must be [B, T] and pivot [B]; got {tuple(turn_index.shape)} and {tuple(pivot.shape)}")
    first_kept = pivot.clamp(min=0).unsqueeze(1)
    return (turn_index >= 0) & (turn_index >= first_kept)
