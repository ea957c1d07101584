"""Trajectories (+ per-sequence advantages) to a padded ExperienceBatch."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from r3lightning.algos.masks import pivotal_mask
from r3lightning.types import ExperienceBatch, Trajectory


def trajectory_tensors(traj: Trajectory) -> tuple[list[int], list[int], list[float]]:
    """(token ids, turn index per token (-1 off-turn or untrainable), behaviour log-prob per token)."""
    ids: list[int] = []
    turn_index: list[int] = []
    logprobs: list[float] = []
    for i, turn in enumerate(traj.turns):
        ids.extend(turn.context_ids)
        turn_index.extend([-1] * len(turn.context_ids))
        logprobs.extend([0.0] * len(turn.context_ids))
        ids.extend(turn.response_ids)
        turn_index.extend([i if turn.trainable else -1] * len(turn.response_ids))
        logprobs.extend(turn.logprobs if turn.logprobs is not None else [0.0] * len(turn.response_ids))
    return ids, turn_index, logprobs


def collate_experience(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float],
    pad_token_id: int,
    pivotal_credit: bool = True,
    max_length: Optional[int] = None,
    sft_rows: Optional[Sequence[bool]] = None,
    replay_behaviour: str = "stored",
) -> ExperienceBatch:
    """Pad ``trajectories`` to [B, T] and build the masks.

    advantages: one value per trajectory (ignored for SFT trajectories).
    RL trajectories get ``loss_mask`` on their assistant tokens — only turns >= pivot when
    ``pivotal_credit`` is on and the trajectory has a pivot — and none when the reward errored.
    SFT trajectories (``Trajectory.is_sft``) get ``sft_mask`` on their assistant tokens instead.
    max_length: sequences longer than this are cut on the right (their tail gets no loss).
    sft_rows: which rows the SFT head trains (default: ``Trajectory.is_sft``); meta-task samples
        trained as positive RL samples are SFT-origin rows marked False here.
    replay_behaviour: what replayed rows' behaviour log-probs are (``row_behaviour``).
    """
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    rows = [trajectory_tensors(t) for t in trajectories]
    width = max((len(ids) for ids, _, _ in rows), default=0)
    if max_length is not None:
        width = min(width, max_length)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    turn_index = torch.full((batch, width), -1, dtype=torch.long)
    old_logprobs = torch.zeros((batch, width), dtype=torch.float32)
    for b, (ids, turns, logps) in enumerate(rows):
        n = min(len(ids), width)
        input_ids[b, :n] = torch.tensor(ids[:n], dtype=torch.long)
        attention_mask[b, :n] = 1
        turn_index[b, :n] = torch.tensor(turns[:n], dtype=torch.long)
        old_logprobs[b, :n] = torch.tensor(logps[:n], dtype=torch.float32)
    # Token 0 has no prediction; keeping it out of every mask keeps the shift in the loss exact.
    turn_index[:, :1] = -1
    is_sft = torch.tensor(list(sft_rows) if sft_rows is not None else [t.is_sft for t in trajectories], dtype=torch.bool)
    usable = torch.tensor([not t.reward_error for t in trajectories], dtype=torch.bool)
    pivots = torch.tensor(
        [(t.pivot if (pivotal_credit and t.pivot is not None) else -1) for t in trajectories], dtype=torch.long
    )
    assistant = turn_index >= 0
    rl_rows = (~is_sft & usable).unsqueeze(1)
    loss_mask = (pivotal_mask(turn_index, pivots) & rl_rows).float()
    sft_mask = (assistant & is_sft.unsqueeze(1)).float()
    adv = torch.tensor(list(advantages), dtype=torch.float32).unsqueeze(1) * loss_mask
    return ExperienceBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        sft_mask=sft_mask,
        turn_index=turn_index,
        advantages=adv,
        old_logprobs=old_logprobs,
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        origins=[t.origin for t in trajectories],
        task_ids=[t.task_id for t in trajectories],
        behaviour=[row_behaviour(t.origin, replay_behaviour) for t in trajectories],
    )


def row_behaviour(origin: str, replay_behaviour: str = "stored") -> str:
    """What a row's behaviour log-probs are (``ExperienceBatch.behaviour``), from its origin:
    ``pinned`` for off-policy refinements (sampled with a critique in context, so no log-prob of these
    tokens under the plain prompt), ``replay_behaviour`` for replayed samples, ``sampled`` otherwise."""
    if replay_behaviour not in ("stored", "pinned"):
        raise ValueError(f"replay behaviour must be 'stored' or 'pinned', got {replay_behaviour!r}")
    if origin == "off_policy":
        return "pinned"
    if origin == "replay":
        return replay_behaviour
    return "sampled"
