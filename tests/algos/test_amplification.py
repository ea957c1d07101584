"""Positive amplification never ranks a partial success above a full one (R³L fidelity, item 1)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.algos import ADVANTAGE_ESTIMATORS, compute_advantages, positive_amplification


def test_lone_partial_success_among_failures_stays_below_alpha():
    """The case the literal formula gets wrong: z-score 2.47 of a 0.5 among seven zeros, x3 = 7.42."""
    rewards = torch.tensor([0.5] + [0.0] * 7)
    group = torch.zeros(8, dtype=torch.long)
    advantages = compute_advantages(rewards, group, "grpo")
    assert float(advantages[0]) == pytest.approx(2.4749, abs=1e-3)
    amplified = positive_amplification(advantages, rewards, alpha=3.0, max_reward=1.0, max_reward_mode="alpha")
    assert float(amplified[0]) == pytest.approx(3.0)  # capped at what a full success gets
    one = positive_amplification(advantages, rewards, alpha=3.0, max_reward=1.0, max_reward_mode="one")
    assert float(one[0]) == pytest.approx(1.0)


def test_small_positive_advantages_are_still_scaled_by_alpha():
    amplified = positive_amplification(torch.tensor([0.2, -0.4]), torch.tensor([0.6, 0.0]), alpha=3.0)
    assert amplified.tolist() == pytest.approx([0.6, -0.4])


rewards_strategy = st.lists(
    st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]), min_size=1, max_size=8), min_size=1, max_size=5
)


@settings(max_examples=200, deadline=None)
@given(groups=rewards_strategy, estimator=st.sampled_from(ADVANTAGE_ESTIMATORS), mode=st.sampled_from(["alpha", "one"]),
       alpha=st.sampled_from([1.5, 3.0, 5.0]))
def test_no_partial_success_outranks_a_full_one(groups, estimator, mode, alpha):
    rewards = torch.tensor([r for g in groups for r in g])
    index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
    amplified = positive_amplification(compute_advantages(rewards, index, estimator), rewards, alpha, 1.0, mode)
    top = alpha if mode == "alpha" else 1.0
    full = rewards >= 1.0
    assert torch.all(amplified[full] == top)
    assert torch.all(amplified[~full] <= top + 1e-6), (rewards.tolist(), amplified.tolist())
