"""Context distillation's token bookkeeping: the same response scored under another prompt.

A teacher that sees a different prompt (ReflectRL: the question with a golden negative in context)
than the student (the plain question) scores the *same* response tokens. These functions build the
teacher's rows (its prompt, then the student row's tokens after the student's prompt) and map each of
the student's next-token predictions to the teacher's prediction of the same token.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def prompt_lengths(turn_index: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Tokens before each row's first generated token [B] (long): the first position with
    ``turn_index >= 0``; a row that generated nothing is all prompt (its length).

    turn_index: [B, T], -1 outside assistant tokens; attention_mask: [B, T], right-padded.
    """
    generated = turn_index >= 0
    length = attention_mask.sum(dim=1).long()
    first = generated.int().argmax(dim=1).long()
    return torch.where(generated.any(dim=1), first, length)


def splice_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: torch.Tensor,
    teacher_prompts: Sequence[Optional[Sequence[int]]],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's rows: ``teacher_prompts[i]`` (or row i's own prompt when None) followed by row i's
    tokens from ``prompt_len[i]`` on.

    input_ids, attention_mask: [B, T] right-padded student rows; prompt_len: [B] (``prompt_lengths``).
    Returns (teacher_ids [B, T'], teacher_mask [B, T'], offset [B]): right-padded with ``pad_id``, and
    per row how many positions later the same token sits in the teacher's row than in the student's.
    """
    rows, lengths, offsets = [], attention_mask.sum(dim=1).tolist(), []
    for i, prompt in enumerate(teacher_prompts):
        own = int(prompt_len[i])
        head = input_ids[i, :own] if prompt is None else torch.as_tensor(list(prompt), dtype=input_ids.dtype, device=input_ids.device)
        rows.append(torch.cat([head, input_ids[i, own : int(lengths[i])]]))
        offsets.append(len(head) - own)
    width = max(len(r) for r in rows)
    teacher_ids = input_ids.new_full((len(rows), width), pad_id)
    teacher_mask = attention_mask.new_zeros((len(rows), width))
    for i, row in enumerate(rows):
        teacher_ids[i, : len(row)] = row
        teacher_mask[i, : len(row)] = 1
    return teacher_ids, teacher_mask, torch.tensor(offsets, dtype=torch.long, device=input_ids.device)


def aligned_predictions(
    prompt_len: torch.Tensor, offset: torch.Tensor, student_start: int, student_width: int, teacher_start: int, teacher_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the teacher predicts what the student predicts.

    The student's window holds predictions ``student_start .. student_width-2`` (prediction p scores
    token p+1), the teacher's ``teacher_start .. teacher_width-2``. Student prediction p of row i is of
    a response token when ``p >= prompt_len[i] - 1``; the teacher predicts that token at ``p + offset[i]``.
    Returns (index [B, student_width-1-student_start] long into the teacher's window, valid [same]
    bool): valid only for response-token predictions that fall in the teacher's window; index is 0
    where not valid.
    """
    p = torch.arange(student_start, student_width - 1, device=prompt_len.device).unsqueeze(0)
    teacher_p = p + offset.unsqueeze(1)
    valid = (p >= prompt_len.unsqueeze(1) - 1) & (teacher_p >= teacher_start) & (teacher_p <= teacher_width - 2)
    index = torch.where(valid, teacher_p - teacher_start, torch.zeros_like(teacher_p))
    return index, valid
