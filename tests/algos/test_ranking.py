import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.algos.ranking import (
    global_stability_score,
    local_exploration_score,
    ranking_reward,
    structural_entropy_score,
)


def test_local_exploration_hand_computed():
    entropy = torch.tensor([[3.0, 1.0, 4.0, 1.0, 5.0, 9.0], [2.0, 8.0, 0.0, 6.0, 0.0, 0.0], [7.0] * 6])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0] * 6])
    # row 0: k = ceil(0.5 * 6) = 3 -> (9 + 5 + 4) / 3 = 6
    # row 1: masked 2, 0, 6 (the unmasked 8 never counts), k = ceil(1.5) = 2 -> (6 + 2) / 2 = 4
    # row 2: no masked token -> 0
    assert local_exploration_score(entropy, mask, top_q=0.5).tolist() == pytest.approx([6.0, 4.0, 0.0])
    # a tiny q still keeps one token; q = 1 is the plain masked mean
    assert local_exploration_score(entropy, mask, top_q=0.01).tolist() == pytest.approx([9.0, 6.0, 0.0])
    assert local_exploration_score(entropy, mask, top_q=1.0).tolist() == pytest.approx([23 / 6, 8 / 3, 0.0])


def test_local_exploration_top_q_has_no_float_rounding_error():
    # 0.1 * 30 = 3.0000000000000004 in floats: k must be 3 (mean of 29, 28, 27), not 4
    entropy = torch.arange(30.0).unsqueeze(0)
    assert local_exploration_score(entropy, torch.ones(1, 30), top_q=0.1).item() == pytest.approx(28.0)


def test_global_stability_hand_computed():
    entropy = torch.tensor([[1.0, 3.0, 5.0, 7.0, 2.0, 2.0], [1.0, 2.0, 0.0, 0.0, 0.0, 0.0], [4.0] * 6])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0] * 6])
    # row 0: window means 2, 6, 2 -> centre 10/3, population var (16 + 64 + 16) / 9 / 3 = 32/9
    # row 1: a single window -> 0; row 2: no tokens -> 0
    expected = [-math.sqrt(32) / 3, 0.0, 0.0]
    assert global_stability_score(entropy, mask, window=2).tolist() == pytest.approx(expected)


def test_global_stability_skips_unmasked_tokens_and_keeps_short_last_window():
    entropy = torch.tensor([[1.0, 100.0, 3.0, 5.0, 100.0, 9.0]])
    mask = torch.tensor([[1, 0, 1, 1, 0, 1]])
    # masked tokens 1, 3, 5, 9 -> windows [1, 3, 5] (mean 3) and [9] (mean 9) -> std 3
    assert global_stability_score(entropy, mask, window=3).item() == pytest.approx(-3.0)


def test_structural_entropy_score_is_weighted_sum():
    entropy = torch.tensor([[1.0, 3.0, 5.0, 7.0, 2.0, 2.0]])
    mask = torch.ones(1, 6)
    # local (q = 0.5, k = 3): (7 + 5 + 3) / 3 = 5; global (window 2): -sqrt(32)/3
    score = structural_entropy_score(entropy, mask, top_q=0.5, window=2, weight_local=2.0, weight_global=0.5)
    assert score.item() == pytest.approx(2.0 * 5.0 - 0.5 * math.sqrt(32) / 3)


def test_flat_and_bursty_profiles_are_ordered_by_the_formula():
    # Same mean entropy (1.0); the bursty one spends it on one forking token.
    flat = [1.0] * 8
    bursty = [0.5] * 7 + [4.5]
    entropy, mask = torch.tensor([flat, bursty]), torch.ones(2, 8)
    # local (q = 0.25, k = 2): flat 1, bursty (4.5 + 0.5) / 2 = 2.5
    # global (window 4): flat windows 1, 1 -> 0; bursty windows 0.5, 1.5 -> -0.5
    local = local_exploration_score(entropy, mask, top_q=0.25)
    stability = global_stability_score(entropy, mask, window=4)
    assert local.tolist() == pytest.approx([1.0, 2.5])
    assert stability.tolist() == pytest.approx([0.0, -0.5])
    # equal weights favour the burst of exploration (2.0 > 1.0) ...
    explore = structural_entropy_score(entropy, mask, 0.25, 4, weight_local=1.0, weight_global=1.0)
    assert explore.tolist() == pytest.approx([1.0, 2.0])
    # ... a heavy stability weight favours the flat profile (1.0 > 2.5 - 4 * 0.5 = 0.5)
    steady = structural_entropy_score(entropy, mask, 0.25, 4, weight_local=1.0, weight_global=4.0)
    assert steady.tolist() == pytest.approx([1.0, 0.5])


def test_ranking_reward_hand_computed():
    # group 0: failed scores 0.3, 0.9, 0.1 (+ one success); group 1: a lone failure (+ one success);
    # group 2: three failures, two tied. Groups interleaved.
    scores = torch.tensor([0.3, 0.5, 0.9, 7.0, 0.5, 0.1, 0.2, 0.0, 3.0])
    groups = torch.tensor([0, 2, 0, 1, 2, 0, 2, 0, 1])
    failed = torch.tensor([True, True, True, False, True, True, True, False, True])
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.5, 0.0])
    out = ranking_reward(scores, rewards, failed, groups, r_fail=0.1, delta=0.4, success_margin=1.0)
    # group 0 ranks 1, 2, 0 of 3 -> 0.1 + 0.4 * {1/2, 1, 0}
    # group 1 lone failure -> 0.1 + 0.4 / 2
    # group 2: 0.2 has rank 0; the tied 0.5s share ranks 1 and 2 -> 1.5 / 2
    expected = [0.3, 0.4, 0.5, 1.0, 0.4, 0.1, 0.1, 1.5, 0.3]
    assert out.tolist() == pytest.approx(expected)


def test_ranking_reward_bonus_is_zero_on_successes():
    rewards = torch.tensor([1.0, 0.0, 0.0])
    out = ranking_reward(
        torch.tensor([0.0, 2.0, 1.0]), rewards, torch.tensor([False, True, True]), torch.zeros(3, dtype=torch.long),
        r_fail=0.0, delta=0.2, success_margin=1.0,
    )
    assert (out - rewards).tolist() == pytest.approx([0.0, 0.2, 0.0])


@pytest.mark.parametrize("r_fail, delta", [(0.5, 0.5), (0.9, 0.2), (1.0, 0.0)])
def test_ranking_reward_rejects_delta_reaching_success(r_fail, delta):
    with pytest.raises(ValueError, match="delta"):
        ranking_reward(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long),
                       r_fail=r_fail, delta=delta, success_margin=1.0)


def test_ranking_reward_rejects_negative_delta():
    with pytest.raises(ValueError, match="delta must be >= 0"):
        ranking_reward(torch.zeros(1), torch.zeros(1), torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.long),
                       r_fail=0.0, delta=-0.1, success_margin=1.0)


@st.composite
def _groups(draw):
    n = draw(st.integers(1, 24))
    groups = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    failed = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # few distinct values, so ties are common
    scores = draw(st.lists(st.sampled_from([-1.0, 0.0, 0.25, 0.5, 2.0]) | st.floats(-5, 5), min_size=n, max_size=n))
    success_rewards = draw(st.lists(st.floats(1.0, 2.0), min_size=n, max_size=n))
    rewards = [0.0 if f else r for f, r in zip(failed, success_rewards)]
    return (torch.tensor(scores, dtype=torch.float64), torch.tensor(rewards, dtype=torch.float64),
            torch.tensor(failed), torch.tensor(groups))


@settings(deadline=None)
@given(batch=_groups(), r_fail=st.floats(-1.0, 0.5), delta=st.floats(0.0, 0.49))
def test_ranking_reward_never_lets_a_failure_reach_a_success(batch, r_fail, delta):
    scores, rewards, failed, groups = batch
    out = ranking_reward(scores, rewards, failed, groups, r_fail=r_fail, delta=delta, success_margin=1.0)
    assert torch.equal(out[~failed], rewards[~failed])
    assert bool((out[failed] >= r_fail - 1e-12).all()) and bool((out[failed] <= r_fail + delta + 1e-12).all())
    assert bool((out[failed] < 1.0).all())
    # higher score, higher reward, within a group's failures
    for i in failed.nonzero().flatten().tolist():
        for j in failed.nonzero().flatten().tolist():
            if groups[i] == groups[j] and scores[i] < scores[j]:
                assert out[i] <= out[j]
                if delta > 1e-6:
                    assert out[i] < out[j]


@settings(deadline=None)
@given(batch=_groups(), data=st.data())
def test_ranking_reward_is_invariant_to_sample_order(batch, data):
    scores, rewards, failed, groups = batch
    perm = torch.tensor(data.draw(st.permutations(range(len(scores)))))
    kwargs = dict(r_fail=0.0, delta=0.5, success_margin=1.0)
    out = ranking_reward(scores, rewards, failed, groups, **kwargs)
    permuted = ranking_reward(scores[perm], rewards[perm], failed[perm], groups[perm], **kwargs)
    unpermuted = torch.empty_like(permuted)
    unpermuted[perm] = permuted
    assert torch.equal(unpermuted, out)
