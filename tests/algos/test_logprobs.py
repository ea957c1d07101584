"""Where the loss starts reading next-token predictions (``scored_window_start``)."""

import torch

from r3lightning.algos.logprobs import scored_window_start


def _batch(rows: list[tuple[int, int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded masks from (length, first scored token) per row (first scored token -1: none)."""
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (length, first) in enumerate(rows):
        attention[i, :length] = 1
        if first >= 0:
            scored[i, first:length] = True
    return scored, attention


def test_first_prediction_any_row_scores():
    # Tokens 5.. and 7.. scored: prediction 4 (of token 5) is the first one read.
    assert scored_window_start(*_batch([(9, 5), (10, 7)], 10)) == 4


def test_capped_so_every_prefix_is_real_tokens():
    # The second row has 3 tokens and nothing scored: only its first 2 tokens may be a shared prefix.
    assert scored_window_start(*_batch([(9, 6), (3, -1)], 10)) == 2
    # Nothing scored anywhere: everything but the last prediction of the shortest row can be skipped.
    assert scored_window_start(*_batch([(9, -1), (6, -1)], 10)) == 5


def test_nothing_to_skip():
    assert scored_window_start(*_batch([(4, 1), (6, 3)], 6)) == 0  # token 1 is scored: prediction 0 is read
    assert scored_window_start(*_batch([(1, -1)], 1)) == 0  # a single column: no prediction at all
    assert scored_window_start(*_batch([(0, -1), (5, 3)], 5)) == 0  # an empty row
