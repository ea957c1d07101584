"""Reasoning steps inside one assistant message (R³L step-level pivots for single-turn tasks).

A single-turn response is split into steps on token boundaries, and the message is represented as
consecutive *step turns*: the first keeps the message's context, the later ones have none, so the
trajectory's token sequence is unchanged while every token knows the step that produced it. Pivots,
the pivotal mask and the collator then work on steps exactly as they work on turns.
"""

from __future__ import annotations

import dataclasses

from r3lightning.types import Trajectory, Turn


def step_lengths(pieces: list[str]) -> list[int]:
    """Token count of each step of a response; the counts sum to ``len(pieces)``.

    pieces: the text of each response token decoded on its own (special tokens as ``""``).

    Rule: a line ends after every token whose text ends with a newline; a newline inside a token
    does not end a line, so steps always fall on token boundaries. A blank line (whitespace only,
    e.g. an empty line or the end-of-turn token) is merged into the step before it, or, at the
    start, into the first non-blank line. Each step is therefore one non-blank line with the blank
    lines after it. A response without a non-blank line is a single step (an empty response: one
    step of 0 tokens).
    """
    lines: list[tuple[int, bool]] = []  # (token count, blank)
    start = 0
    for i, piece in enumerate(pieces):
        if piece.endswith("\n") or i == len(pieces) - 1:
            lines.append((i + 1 - start, not "".join(pieces[start : i + 1]).strip()))
            start = i + 1
    steps: list[int] = []
    leading_blank = 0
    for count, blank in lines:
        if not blank:
            steps.append(leading_blank + count)
            leading_blank = 0
        elif steps:
            steps[-1] += count
        else:
            leading_blank += count
    return steps or [len(pieces)]


def split_steps(token_ids: list[int], tokenizer) -> list[list[int]]:
    """``token_ids`` cut into steps by ``step_lengths``; the steps concatenate to ``token_ids``."""
    pieces = tokenizer.batch_decode([[tok] for tok in token_ids], skip_special_tokens=True)
    steps, start = [], 0
    for count in step_lengths(pieces):
        steps.append(list(token_ids[start : start + count]))
        start += count
    # A character split over several byte tokens decodes as U+FFFD piece by piece, so a line of, e.g.,
    # "\x85" looks non-blank above; apply the blank-line rule once more to each step's real text.
    merged: list[list[int]] = []
    for step in steps:
        if merged and not tokenizer.decode(step, skip_special_tokens=True).strip():
            merged[-1].extend(step)
        else:
            merged.append(step)
    if len(merged) > 1 and not tokenizer.decode(merged[0], skip_special_tokens=True).strip():
        merged[1] = merged[0] + merged[1]
        merged.pop(0)
    return merged


def step_turns(turn: Turn, steps: list[list[int]]) -> list[Turn]:
    """``turn`` as one step turn per step (``steps`` concatenate to its response ids).

    The first keeps the turn's context and observation, the others have no context; the last keeps
    the action and feedback (the environment saw the whole message). Log-probs are split with the
    tokens; ``trainable`` is kept on all.
    """
    out, start = [], 0
    for j, ids in enumerate(steps):
        end = start + len(ids)
        out.append(
            Turn(
                context_ids=list(turn.context_ids) if j == 0 else [],
                response_ids=list(ids),
                logprobs=None if turn.logprobs is None else list(turn.logprobs[start:end]),
                feedback=turn.feedback if j == len(steps) - 1 else "",
                action=turn.action if j == len(steps) - 1 else "",
                observation=turn.observation if j == 0 else "",
                trainable=turn.trainable,
            )
        )
        start = end
    if start != len(turn.response_ids):
        raise ValueError(f"steps hold {start} tokens, the turn has {len(turn.response_ids)}")
    return out


def split_final_turn(trajectory: Trajectory, tokenizer) -> Trajectory:
    """``trajectory`` with its last turn (the reasoning message) replaced by its step turns."""
    if not trajectory.turns:
        return trajectory
    last = trajectory.turns[-1]
    steps = step_turns(last, split_steps(last.response_ids, tokenizer))
    return dataclasses.replace(trajectory, turns=[*trajectory.turns[:-1], *steps])
