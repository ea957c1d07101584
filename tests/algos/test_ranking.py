import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.algos.advantages import compute_advantages
from r3lightning.algos.ranking import (
    add_failure_bonus,
    global_stability_score,
    keep_first,
    local_exploration_score,
    lowest_success_advantage,
    order_from_scores,
    pairwise_entropy_order,
    ranking_bonus,
    ranking_peers,
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


def test_keep_first_cuts_each_row_to_its_first_masked_tokens():
    mask = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert keep_first(mask, torch.tensor([2, 5])).long().tolist() == [[1, 0, 1, 0, 0], [1, 1, 1, 0, 0]]


def test_pairs_are_compared_on_the_tokens_both_have_hand_computed():
    # a: 4 tokens, b: 6 tokens, c: 1 token; top_k 2, window 2, weights 1 and 2.
    entropy, mask = _rows([[1.0, 3.0, 0.0, 2.0], [2.0, 2.0, 0.0, 0.0, 9.0, 9.0], [7.0]])
    peers = torch.ones(3, 3, dtype=torch.bool)
    order = pairwise_entropy_order(entropy, mask, peers, top_k=2, window=2, weight_local=1.0, weight_global=2.0)
    # a vs b on 4 tokens: L_a = (3 + 2) / 2 = 2.5, L_b = 2; windows a: 2, 1 -> G = -0.5; b: 2, 0 -> G = -1
    #   S_a = 2.5 - 1 = 1.5 > S_b = 2 - 2 = 0 (b's 9s at tokens 5-6 are not compared)
    # c vs anyone on 1 token: no top-2, no two windows -> tie
    assert order.tolist() == [[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # on 3 tokens (b cut) the two-window scale needs m > window: a vs b at window 3 compare L only
    order = pairwise_entropy_order(entropy, mask, peers, top_k=2, window=4, weight_local=1.0, weight_global=2.0)
    assert order[0, 1] == 1.0 and order[1, 0] == -1.0  # 2.5 > 2 on L alone


def test_order_from_scores_is_antisymmetric_on_peers_only():
    peers = ranking_peers(torch.tensor([True, True, False, True]), torch.tensor([0, 0, 0, 1]))
    order = order_from_scores(torch.tensor([0.5, 0.1, 9.0, 3.0]), peers)
    assert order.tolist() == [[0.0, 1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]


def test_flat_and_bursty_profiles_are_ordered_by_the_formula():
    # Same mean entropy (1.0); the bursty one spends it on one forking token.
    entropy, mask = _rows([[1.0] * 8, [0.5] * 7 + [4.5]])
    local = local_exploration_score(entropy, mask, top_k=2)  # flat 1, bursty (4.5 + 0.5) / 2 = 2.5
    stability = global_stability_score(entropy, mask, window=4)  # flat windows 1, 1 -> 0; bursty 0.5, 1.5 -> -0.5
    assert local.tolist() == pytest.approx([1.0, 2.5])
    assert stability.tolist() == pytest.approx([0.0, -0.5])
    peers = torch.ones(2, 2, dtype=torch.bool)
    # S = L + G: flat 1, bursty 2 -> bursty wins; S = L + 4 G: flat 1, bursty 0.5 -> flat wins
    assert pairwise_entropy_order(entropy, mask, peers, 2, 4, 1.0, 1.0)[1, 0] == 1.0
    assert pairwise_entropy_order(entropy, mask, peers, 2, 4, 1.0, 4.0)[1, 0] == -1.0


@settings(deadline=None)
@given(level=st.floats(0.01, 5.0), top_k=st.integers(1, 4), window=st.integers(1, 4), max_len=st.integers(2, 16))
def test_score_does_not_move_with_length_at_a_constant_entropy_profile(level, top_k, window, max_len):
    lengths = list(range(1, max_len + 1))
    entropy, mask = _rows([[level] * n for n in lengths])
    peers = torch.ones(len(lengths), len(lengths), dtype=torch.bool)
    assert not pairwise_entropy_order(entropy, mask, peers, top_k, window, 1.0, 1.0).any()


def _empty_box_group() -> tuple[torch.Tensor, torch.Tensor]:
    """Six well-formed wrong answers and one empty box whose first four predictions share their
    entropies (the digit decision after ``\\boxed{`` is the most uncertain), as in the 2026-12-02 review."""
    ok6 = [0.05, 0.02, 0.03, 1.9, 0.15, 0.10]
    ok6b = [0.05, 0.02, 0.03, 1.9, 0.30, 0.10]
    ok7 = [0.05, 0.02, 0.03, 1.9, 0.60, 0.40, 0.10]
    empty = [0.05, 0.02, 0.03, 1.9, 0.10]
    return _rows([ok6, ok6b, ok7, ok6, ok6b, ok7, ok6, empty])


@pytest.mark.parametrize("top_k, window", [(2, 3), (2, 4), (3, 2)])
def test_the_empty_box_does_not_rank_first_by_its_entropies(top_k, window):
    entropy, mask = _empty_box_group()
    n = entropy.shape[0]
    ranked, group = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    order = pairwise_entropy_order(entropy, mask, ranking_peers(ranked, group), top_k, window, 1.0, 1.0)
    # Same tier for all (the entropies alone decide): the empty box is last or level with the last.
    bonus = ranking_bonus(order, torch.ones(n, dtype=torch.long), ranked, group, delta=0.2)
    assert bonus[-1] <= bonus[:-1].min() + 1e-12


@pytest.mark.parametrize("top_k, window", [(2, 3), (2, 4), (3, 2), (1, 3)])
def test_the_empty_box_ranks_last_by_its_tier(top_k, window):
    # At (1, 3) the entropies alone put the empty box first: on the five tokens all share, its fifth
    # (0.10) is calmer than the others' (0.15-0.60), so its two windows spread least. The environment
    # cannot read an empty box (tier 0), and the tier is compared first.
    entropy, mask = _empty_box_group()
    n = entropy.shape[0]
    ranked, group = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long)
    order = pairwise_entropy_order(entropy, mask, ranking_peers(ranked, group), top_k, window, 1.0, 1.0)
    tier = torch.tensor([1] * (n - 1) + [0])
    bonus = ranking_bonus(order, tier, ranked, group, delta=0.2)
    assert bonus[-1] == pytest.approx(-0.1) and bonus[:-1].min() > -0.1


def test_a_readable_wrong_answer_ranks_above_an_unreadable_one_whatever_the_scores():
    scores = torch.tensor([0.1, 5.0, 0.2])
    tier = torch.tensor([1, 0, 1])
    ranked, group = torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long)
    bonus = ranking_bonus(order_from_scores(scores, ranking_peers(ranked, group)), tier, ranked, group, delta=0.2)
    # order: (0, 5.0) < (1, 0.1) < (1, 0.2) -> ranks 1, 0, 2 of 3 -> 0.2 * (rank / 2 - 1/2)
    assert bonus.tolist() == pytest.approx([0.0, -0.1, 0.1])


def test_ranking_bonus_hand_computed():
    # group 0: ranked scores 0.3, 0.9, 0.1 (+ one unranked success); group 1: a lone ranked failure;
    # group 2: three ranked failures, two tied. Groups interleaved.
    scores = torch.tensor([0.3, 0.5, 0.9, NAN, 0.5, 0.1, 0.2, NAN, 3.0])
    groups = torch.tensor([0, 2, 0, 1, 2, 0, 2, 0, 1])
    ranked = torch.tensor([True, True, True, False, True, True, True, False, True])
    tier = torch.ones(9, dtype=torch.long)
    bonus = ranking_bonus(order_from_scores(scores, ranking_peers(ranked, groups)), tier, ranked, groups, delta=0.4)
    # group 0 ranks 1, 2, 0 of 3 -> 0.4 * {0, 1/2, -1/2}; group 1 lone -> 0
    # group 2: 0.2 has rank 0; the tied 0.5s share ranks 1 and 2 (1.5 of 2) -> 0.4 * 1/4 each
    expected = [0.0, 0.1, 0.2, 0.0, 0.1, -0.2, -0.2, 0.0, 0.0]
    assert bonus.tolist() == pytest.approx(expected)


def test_ranking_bonus_rejects_negative_delta():
    with pytest.raises(ValueError, match="delta must be >= 0"):
        ranking_bonus(torch.zeros(1, 1), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool),
                      torch.zeros(1, dtype=torch.long), delta=-0.1)


def test_failure_bonus_is_capped_at_the_steps_lowest_success_advantage():
    advantages = torch.tensor([1.0, 0.5, -0.3, -0.4, 0.0, 0.0, 0.7])
    bonus = torch.tensor([0.0, 0.0, 0.9, 0.1, 0.6, -0.1, 0.2])
    success = torch.tensor([True, True, False, False, False, False, False])
    ceiling = lowest_success_advantage(advantages, success)
    assert ceiling == pytest.approx(0.5)
    adjusted, capped = add_failure_bonus(advantages, bonus, success, ceiling)
    # row 2: -0.3 + 0.9 = 0.6 > 0.5 -> 0.5; row 4, in a group without a success: 0.6 -> 0.5 as well (the
    # cap is the step's); row 6, a failure the estimator put at 0.7 (non-binary reward): the bonus may
    # not raise it, and the cap does not lower it below its own advantage
    assert adjusted.tolist() == pytest.approx([1.0, 0.5, 0.5, -0.3, 0.5, -0.1, 0.7])
    assert capped.tolist() == [False, False, True, False, True, False, True]
    assert lowest_success_advantage(advantages, torch.zeros(7, dtype=torch.bool)) == math.inf


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
    bonus = ranking_bonus(order_from_scores(scores, ranking_peers(ranked, groups)), tier, ranked, groups, delta)
    adjusted, _ = add_failure_bonus(advantages, bonus, success, lowest_success_advantage(advantages, success))
    for i in range(len(rewards)):
        for j in range(len(rewards)):
            if success[i] and not success[j]:  # any two groups
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
    out = ranking_bonus(order_from_scores(scores, ranking_peers(ranked, groups)), tier, ranked, groups, 0.5)
    permuted = ranking_bonus(order_from_scores(scores[perm], ranking_peers(ranked[perm], groups[perm])), tier[perm],
                             ranked[perm], groups[perm], 0.5)
    unpermuted = torch.empty_like(permuted)
    unpermuted[perm] = permuted
    assert torch.equal(unpermuted, out)
