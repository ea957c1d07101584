import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.algos.advantages import compute_advantages
from r3lightning.algos.ranking import (
    add_failure_bonus,
    global_stability_score,
    local_exploration_score,
    ranking_bonus,
    structural_entropy_score,
)

NAN = float("nan")


def _rows(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded entropy [B, T] and mask [B, T] of per-row entropy lists."""
    width = max(len(r) for r in rows)
    entropy, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        entropy[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return entropy, mask


def test_local_exploration_hand_computed():
    entropy = torch.tensor([[3.0, 1.0, 4.0, 1.0, 5.0, 9.0], [2.0, 8.0, 0.0, 6.0, 0.0, 0.0], [7.0] * 6])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0] * 6])
    # row 0: top 3 of 3,1,4,1,5,9 -> (9 + 5 + 4) / 3 = 6
    # row 1: masked 2, 0, 6 (the unmasked 8 never counts) -> (6 + 2 + 0) / 3
    # row 2: no masked token -> undefined
    assert local_exploration_score(entropy, mask, top_k=3).tolist() == pytest.approx([6.0, 8 / 3, NAN], nan_ok=True)
    assert local_exploration_score(entropy, mask, top_k=1).tolist() == pytest.approx([9.0, 6.0, NAN], nan_ok=True)
    # a k above a row's length is the plain masked mean
    assert local_exploration_score(entropy, mask, top_k=10).tolist() == pytest.approx([23 / 6, 8 / 3, NAN], nan_ok=True)


def test_global_stability_hand_computed():
    entropy = torch.tensor([[1.0, 3.0, 5.0, 7.0, 2.0, 2.0], [1.0, 2.0, 0.0, 0.0, 0.0, 0.0], [4.0] * 6])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0] * 6])
    # row 0: window means 2, 6, 2 -> centre 10/3, population var (16 + 64 + 16) / 9 / 3 = 32/9
    # row 1: a single window -> undefined, not 0 (0 is the best stability); row 2: no tokens -> undefined
    expected = [-math.sqrt(32) / 3, NAN, NAN]
    assert global_stability_score(entropy, mask, window=2).tolist() == pytest.approx(expected, nan_ok=True)


def test_global_stability_skips_unmasked_tokens_and_keeps_short_last_window():
    entropy = torch.tensor([[1.0, 100.0, 3.0, 5.0, 100.0, 9.0]])
    mask = torch.tensor([[1, 0, 1, 1, 0, 1]])
    # masked tokens 1, 3, 5, 9 -> windows [1, 3, 5] (mean 3) and [9] (mean 9) -> std 3
    assert global_stability_score(entropy, mask, window=3).item() == pytest.approx(-3.0)


def test_structural_score_is_weighted_sum_and_fills_undefined_stability_from_its_group():
    local = torch.tensor([5.0, 1.0, 2.0, 4.0, 3.0, 0.5])
    stability = torch.tensor([-1.0, -3.0, NAN, NAN, -2.0, -7.0])
    ranked = torch.tensor([True, True, True, True, True, False])
    groups = torch.tensor([0, 0, 0, 1, 0, 0])
    score = structural_entropy_score(local, stability, ranked, groups, weight_local=2.0, weight_global=0.5)
    # group 0's defined stabilities among ranked rows: -1, -3, -2 (row 5 is not ranked) -> mean -2;
    # group 1 has none -> 0
    expected = [10 - 0.5, 2 - 1.5, 4 - 1.0, 8 + 0.0, 6 - 1.0, NAN]
    assert score.tolist() == pytest.approx(expected, nan_ok=True)


def test_flat_and_bursty_profiles_are_ordered_by_the_formula():
    # Same mean entropy (1.0); the bursty one spends it on one forking token.
    entropy, mask = _rows([[1.0] * 8, [0.5] * 7 + [4.5]])
    local = local_exploration_score(entropy, mask, top_k=2)  # flat 1, bursty (4.5 + 0.5) / 2 = 2.5
    stability = global_stability_score(entropy, mask, window=4)  # flat windows 1, 1 -> 0; bursty 0.5, 1.5 -> -0.5
    assert local.tolist() == pytest.approx([1.0, 2.5])
    assert stability.tolist() == pytest.approx([0.0, -0.5])
    both, group = torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long)
    assert structural_entropy_score(local, stability, both, group, 1.0, 1.0).tolist() == pytest.approx([1.0, 2.0])
    assert structural_entropy_score(local, stability, both, group, 1.0, 4.0).tolist() == pytest.approx([1.0, 0.5])


@settings(deadline=None)
@given(level=st.floats(0.01, 5.0), top_k=st.integers(1, 4), window=st.integers(1, 4), max_len=st.integers(2, 16))
def test_score_does_not_move_with_length_at_a_constant_entropy_profile(level, top_k, window, max_len):
    lengths = list(range(1, max_len + 1))
    entropy, mask = _rows([[level] * n for n in lengths])
    local = local_exploration_score(entropy, mask, top_k)
    stability = global_stability_score(entropy, mask, window)
    ranked, group = torch.ones(len(lengths), dtype=torch.bool), torch.zeros(len(lengths), dtype=torch.long)
    score = structural_entropy_score(local, stability, ranked, group, 1.0, 1.0)
    assert score.tolist() == pytest.approx([score[0].item()] * len(lengths))


def _empty_box_group() -> tuple[torch.Tensor, torch.Tensor]:
    """Six well-formed wrong answers and one empty box whose first four predictions share their
    entropies (the digit decision after ``\\boxed{`` is the most uncertain), as in the 2026-12-02 review."""
    ok6 = [0.05, 0.02, 0.03, 1.9, 0.15, 0.10]
    ok6b = [0.05, 0.02, 0.03, 1.9, 0.30, 0.10]
    ok7 = [0.05, 0.02, 0.03, 1.9, 0.60, 0.40, 0.10]
    empty = [0.05, 0.02, 0.03, 1.9, 0.10]
    return _rows([ok6, ok6b, ok7, ok6, ok6b, ok7, ok6, empty])


@pytest.mark.parametrize("top_k, window", [(2, 3), (2, 4), (3, 2), (1, 3)])
def test_the_empty_box_does_not_rank_first_by_its_entropies(top_k, window):
    entropy, mask = _empty_box_group()
    n = entropy.shape[0]
    ranked, group = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    local = local_exploration_score(entropy, mask, top_k)
    stability = global_stability_score(entropy, mask, window)
    score = structural_entropy_score(local, stability, ranked, group, 1.0, 1.0)
    # Same tier for all (the entropies alone decide): the empty box is last or level with the last.
    bonus = ranking_bonus(score, torch.ones(n, dtype=torch.long), ranked, group, delta=0.2)
    assert bonus[-1] <= bonus[:-1].min() + 1e-12


def test_a_readable_wrong_answer_ranks_above_an_unreadable_one_whatever_the_scores():
    scores = torch.tensor([0.1, 5.0, 0.2])
    tier = torch.tensor([1, 0, 1])
    ranked, group = torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long)
    bonus = ranking_bonus(scores, tier, ranked, group, delta=0.2)
    # order: (0, 5.0) < (1, 0.1) < (1, 0.2) -> ranks 1, 0, 2 of 3 -> 0.2 * (rank / 2 - 1/2)
    assert bonus.tolist() == pytest.approx([0.0, -0.1, 0.1])


def test_ranking_bonus_hand_computed():
    # group 0: ranked scores 0.3, 0.9, 0.1 (+ one unranked success); group 1: a lone ranked failure;
    # group 2: three ranked failures, two tied. Groups interleaved.
    scores = torch.tensor([0.3, 0.5, 0.9, NAN, 0.5, 0.1, 0.2, NAN, 3.0])
    groups = torch.tensor([0, 2, 0, 1, 2, 0, 2, 0, 1])
    ranked = torch.tensor([True, True, True, False, True, True, True, False, True])
    tier = torch.ones(9, dtype=torch.long)
    bonus = ranking_bonus(scores, tier, ranked, groups, delta=0.4)
    # group 0 ranks 1, 2, 0 of 3 -> 0.4 * {0, 1/2, -1/2}; group 1 lone -> 0
    # group 2: 0.2 has rank 0; the tied 0.5s share ranks 1 and 2 (1.5 of 2) -> 0.4 * 1/4 each
    expected = [0.0, 0.1, 0.2, 0.0, 0.1, -0.2, -0.2, 0.0, 0.0]
    assert bonus.tolist() == pytest.approx(expected)


def test_ranking_bonus_rejects_negative_delta():
    with pytest.raises(ValueError, match="delta must be >= 0"):
        ranking_bonus(torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool),
                      torch.zeros(1, dtype=torch.long), delta=-0.1)


def test_failure_bonus_is_capped_at_the_lowest_success_advantage():
    advantages = torch.tensor([1.0, 0.5, -0.3, -0.4, 0.0, 0.0])
    bonus = torch.tensor([0.0, 0.0, 0.9, 0.1, 0.1, -0.1])
    success = torch.tensor([True, True, False, False, False, False])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adjusted, capped = add_failure_bonus(advantages, bonus, success, groups)
    # row 2: -0.3 + 0.9 = 0.6 > 0.5 (lowest success of group 0) -> 0.5; group 1 has no success: no cap
    assert adjusted.tolist() == pytest.approx([1.0, 0.5, 0.5, -0.3, 0.1, -0.1])
    assert capped.tolist() == [False, False, True, False, False, False]


@st.composite
def _groups(draw):
    n = draw(st.integers(1, 24))
    groups = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    success = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # few distinct values, so ties are common
    scores = draw(st.lists(st.sampled_from([-1.0, 0.0, 0.25, 0.5, 2.0]) | st.floats(-5, 5), min_size=n, max_size=n))
    tier = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    generated = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return (torch.tensor(scores, dtype=torch.float64), torch.tensor(tier), torch.tensor(success),
            torch.tensor(groups), torch.tensor(generated))


@settings(deadline=None)
@given(batch=_groups(), estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]), delta=st.floats(0.0, 3.0))
def test_a_failure_never_outranks_a_success_in_advantage(batch, estimator, delta):
    scores, tier, success, groups, generated = batch
    rewards = success.double()
    ranked = ~success & generated
    advantages = compute_advantages(rewards, groups, estimator)
    bonus = ranking_bonus(scores, tier, ranked, groups, delta)
    adjusted, _ = add_failure_bonus(advantages, bonus, success, groups)
    for i in range(len(rewards)):
        for j in range(len(rewards)):
            if groups[i] == groups[j] and success[i] and not success[j]:
                assert adjusted[j] <= adjusted[i] + 1e-12
    # the bonus is centred: it adds nothing to a group's failures on the whole, and spans at most delta
    for g in groups.unique():
        rows = ranked & (groups == g)
        assert float(bonus[rows].sum()) == pytest.approx(0.0, abs=1e-9)
        assert float(bonus.abs().max()) <= delta / 2 + 1e-12
    assert torch.equal(bonus[~ranked], torch.zeros_like(bonus[~ranked]))


@settings(deadline=None)
@given(batch=_groups(), data=st.data())
def test_ranking_bonus_is_invariant_to_sample_order(batch, data):
    scores, tier, success, groups, generated = batch
    ranked = ~success & generated
    perm = torch.tensor(data.draw(st.permutations(range(len(scores)))))
    out = ranking_bonus(scores, tier, ranked, groups, 0.5)
    permuted = ranking_bonus(scores[perm], tier[perm], ranked[perm], groups[perm], 0.5)
    unpermuted = torch.empty_like(permuted)
    unpermuted[perm] = permuted
    assert torch.equal(unpermuted, out)
