import math

import pytest
import torch

from r3lightning.algos import compute_advantages, positive_amplification, zero_variance_group_rate


def test_grpo_hand_computed():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    # group 1: rewards 2, 4 -> mean 3, std sqrt(2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = compute_advantages(rewards, groups, "grpo", eps=0.0)
    s0 = math.sqrt(1 / 3)
    expected = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -1 / math.sqrt(2), 1 / math.sqrt(2)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_grpo_eps_and_flat_group_is_zero():
    adv = compute_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), "grpo", eps=1e-6)
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_dr_grpo_and_opmd_subtract_mean_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    groups = torch.zeros(4, dtype=torch.long)
    for name in ("dr_grpo", "opmd"):
        assert compute_advantages(rewards, groups, name).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_leave_one_out():
    # r=[3,1,2]: baselines (1+2)/2=1.5, (3+2)/2=2.5, (3+1)/2=2 -> 1.5, -1.5, 0
    adv = compute_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0]), "rloo")
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0])


def test_rloo_singleton_group_is_zero():
    assert compute_advantages(torch.tensor([5.0]), torch.tensor([0]), "rloo").tolist() == [0.0]


def test_reinforce_and_raft():
    rewards = torch.tensor([1.0, 0.2, 0.0])
    groups = torch.tensor([0, 0, 1])
    assert compute_advantages(rewards, groups, "reinforce").tolist() == pytest.approx([1.0, 0.2, 0.0])
    assert compute_advantages(rewards, groups, "raft", success_threshold=1.0).tolist() == [1.0, 0.0, 0.0]


def test_unequal_group_sizes():
    # group 0 = [0, 1, 1] (mean 2/3), group 1 = [1, 0] (mean 1/2), interleaved
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 1, 0, 0, 1])
    adv = compute_advantages(rewards, groups, "dr_grpo")
    assert adv.tolist() == pytest.approx([-2 / 3, 0.5, 1 / 3, 1 / 3, -0.5])


def test_unknown_estimator_names_choices():
    with pytest.raises(ValueError, match="grpo"):
        compute_advantages(torch.tensor([1.0]), torch.tensor([0]), "ppo")


def test_positive_amplification_paper_mode():
    adv = torch.tensor([0.5, -0.5, 0.2, 0.0])
    rew = torch.tensor([1.0, 0.0, 0.6, 0.3])
    out = positive_amplification(adv, rew, alpha=3.0, max_reward=1.0, max_reward_mode="alpha")
    # R >= max -> alpha; A > 0 -> 3A; else A
    assert out.tolist() == pytest.approx([3.0, -0.5, 0.6, 0.0])


def test_positive_amplification_reference_mode():
    adv = torch.tensor([0.5, -0.5, 0.2])
    rew = torch.tensor([1.0, 0.0, 0.6])
    out = positive_amplification(adv, rew, alpha=3.0, max_reward=1.0, max_reward_mode="one")
    assert out.tolist() == pytest.approx([1.0, -0.5, 0.6])


def test_zero_variance_group_rate():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert zero_variance_group_rate(rewards, groups) == pytest.approx(2 / 3)
