"""Context distillation's bookkeeping: the teacher's rows hold its prompt and the student's response,
and each student prediction of a response token maps to the teacher's prediction of the same token."""

import torch

from r3lightning.algos.context_distillation import aligned_predictions, prompt_lengths, splice_prompts

PAD = 0


def student_rows():
    # Row 0: prompt [10 11 12], response [20 21]. Row 1: prompt [10 13], response [22], padded.
    input_ids = torch.tensor([[10, 11, 12, 20, 21], [10, 13, 22, PAD, PAD]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    turn_index = torch.tensor([[-1, -1, -1, 0, 0], [-1, -1, 0, -1, -1]])
    return input_ids, attention_mask, turn_index


def test_prompt_lengths_stop_at_the_first_generated_token():
    input_ids, attention_mask, turn_index = student_rows()
    assert prompt_lengths(turn_index, attention_mask).tolist() == [3, 2]
    nothing = torch.tensor([[-1, -1, -1, -1, -1]])
    assert prompt_lengths(nothing, torch.tensor([[1, 1, 1, 0, 0]])).tolist() == [3]


def test_splice_puts_the_teacher_prompt_before_the_same_response():
    input_ids, attention_mask, turn_index = student_rows()
    plen = prompt_lengths(turn_index, attention_mask)
    ids, mask, offset = splice_prompts(input_ids, attention_mask, plen, [[30, 31, 32, 33, 34], None], PAD)
    assert ids.tolist() == [[30, 31, 32, 33, 34, 20, 21], [10, 13, 22, PAD, PAD, PAD, PAD]]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]]
    assert offset.tolist() == [2, 0]


def test_aligned_predictions_by_hand():
    input_ids, attention_mask, turn_index = student_rows()
    plen = prompt_lengths(turn_index, attention_mask)
    ids, _, offset = splice_prompts(input_ids, attention_mask, plen, [[30, 31, 32, 33, 34], None], PAD)
    # Student window from prediction 1 (predictions 1..3 of a width-5 batch); teacher window from 1 (1..5).
    index, valid = aligned_predictions(plen, offset, 1, 5, 1, 7)
    # Row 0: student p=2 predicts 20 (teacher p=4 -> window 3), p=3 predicts 21 (teacher p=5 -> window 4);
    # p=1 predicts the prompt token 12: no counterpart.
    # Row 1: student p=1 predicts 22 (teacher p=1 -> window 0); p=2, 3 are padding predictions, which the
    # teacher row (width 7, prediction up to 5) also has: valid, masked out by the loss mask.
    assert valid.tolist() == [[False, True, True], [True, True, True]]
    assert index.tolist() == [[0, 3, 4], [0, 1, 2]]
    for row, p in ((0, 2), (0, 3), (1, 1)):
        teacher_p = int(index[row, p - 1]) + 1
        assert ids[row, teacher_p + 1] == input_ids[row, p + 1]  # the same token is predicted


def test_predictions_outside_the_teacher_window_are_not_valid():
    plen, offset = torch.tensor([3]), torch.tensor([-2])  # a teacher prompt 2 tokens shorter
    index, valid = aligned_predictions(plen, offset, 0, 5, 1, 3)
    # Student predictions 0..3; response ones are 2, 3 -> teacher 0, 1; the teacher window starts at 1.
    assert valid.tolist() == [[False, False, False, True]]
    assert index.tolist() == [[0, 0, 0, 0]]
