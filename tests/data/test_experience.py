"""The one experience path, without a Trainer: advantages, amplification, masks, SFT rows."""

import math

import pytest

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.experience import make_experience
from r3lightning.data.step_rollout import StepRollout
from r3lightning.rollout.explorers.base import Exploration
from r3lightning.types import Group, Trajectory, Turn


def traj(reward, origin="base", pivot=None, truncated=False, reward_error=False, turns=2):
    """Turns of 2 context + 2 response tokens each, so every turn has exactly 2 trainable tokens."""
    made = [Turn([1, 2], [3, 4], [-0.5, -0.5]) for _ in range(turns)]
    return Trajectory("t", made, reward=reward, success=reward >= 1.0, origin=origin, pivot=pivot,
                      truncated=truncated, reward_error=reward_error)


def per_row_advantage(experience):
    """The one advantage each row carries on its loss tokens (0 for rows without any)."""
    out = []
    for adv, mask in zip(experience.advantages, experience.loss_mask):
        values = adv[mask.bool()]
        out.append(float(values[0]) if len(values) else 0.0)
    return out


def test_grpo_advantages_are_group_z_scores():
    groups = [Group("a", [traj(1.0), traj(0.0)]), Group("b", [traj(1.0), traj(1.0), traj(0.0), traj(0.0)])]
    experience, rows = make_experience(StepRollout(Exploration(groups)), AlgorithmConfig(), pad_token_id=0)
    # Group a: mean 0.5, unbiased std 0.7071 -> +-0.7071; group b: mean 0.5, std 0.5774 -> +-0.8660.
    expected = [1 / math.sqrt(2), -1 / math.sqrt(2), 0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)]
    assert per_row_advantage(experience) == pytest.approx(expected, rel=1e-5)
    assert len(rows) == 6 and experience.loss_mask.sum() == 6 * 4


def test_reward_error_samples_are_left_out_of_their_group_and_masked():
    group = Group("a", [traj(1.0, reward_error=True), traj(1.0), traj(0.0)])
    experience, _ = make_experience(StepRollout(Exploration([group])), AlgorithmConfig(), pad_token_id=0)
    assert experience.loss_mask[0].sum() == 0
    # The errored 1.0 takes no part: the other two are a [1, 0] group, +-0.7071.
    assert per_row_advantage(experience)[1:] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-5)


def test_amplification_gives_max_reward_alpha_and_scales_positive_advantages():
    group = Group("a", [traj(1.0), traj(0.5), traj(0.0), traj(0.0)])
    objective = AlgorithmConfig(advantage="opmd", positive_amplification=True, alpha=3.0)
    experience, _ = make_experience(StepRollout(Exploration([group])), objective, pad_token_id=0)
    # opmd: r - mean (0.375): [0.625, 0.125, -0.375, -0.375]; the 1.0 gets alpha, 0.125 -> 0.375.
    assert per_row_advantage(experience) == pytest.approx([3.0, 0.375, -0.375, -0.375])


def test_pivotal_credit_masks_turns_before_the_pivot():
    group = Group("a", [traj(0.0, pivot=1), traj(1.0, origin="distilled", pivot=1)])
    on, _ = make_experience(StepRollout(Exploration([group])), AlgorithmConfig(pivotal_credit=True), pad_token_id=0)
    off, _ = make_experience(StepRollout(Exploration([group])), AlgorithmConfig(pivotal_credit=False), pad_token_id=0)
    assert on.loss_mask.sum(dim=1).tolist() == [2.0, 2.0] and off.loss_mask.sum(dim=1).tolist() == [4.0, 4.0]


def test_truncated_samples_lose_their_rl_loss_only_when_asked():
    group = Group("a", [traj(0.0, truncated=True), traj(1.0)])
    kept, _ = make_experience(StepRollout(Exploration([group])), AlgorithmConfig(), pad_token_id=0)
    masked, _ = make_experience(StepRollout(Exploration([group])), AlgorithmConfig(mask_truncated=True), pad_token_id=0)
    assert kept.loss_mask[0].sum() == 4 and masked.loss_mask[0].sum() == 0 and masked.advantages[0].abs().sum() == 0


def test_sft_samples_follow_the_rl_rows_on_the_sft_mask_only():
    exploration = Exploration([Group("a", [traj(1.0), traj(0.0)])], sft=[traj(1.0, origin="reflect_sft", turns=1)])
    experience, rows = make_experience(StepRollout(exploration, temperature=0.7), AlgorithmConfig(), pad_token_id=0)
    assert [r.origin for r in rows] == ["base", "base", "reflect_sft"]
    assert experience.sft_mask.sum(dim=1).tolist() == [0.0, 0.0, 2.0] and experience.loss_mask[2].sum() == 0
    assert experience.temperature == 0.7


def test_warm_start_is_an_exploration_of_sft_samples_only():
    demos = [traj(1.0, origin="demo"), traj(1.0, origin="demo", turns=1)]
    experience, rows = make_experience(StepRollout(Exploration([], sft=demos)), AlgorithmConfig(), pad_token_id=0)
    assert experience.loss_mask.sum() == 0 and experience.sft_mask.sum() == 6 and rows == demos


def test_the_rollout_says_what_a_full_success_is_and_how_replayed_rows_are_scored():
    group = Group("a", [traj(2.0), traj(1.0), traj(0.0, origin="replay")])
    objective = AlgorithmConfig(advantage="opmd", positive_amplification=True, alpha=3.0)
    experience, _ = make_experience(StepRollout(Exploration([group]), max_reward=2.0, replay_behaviour="pinned"), objective, 0)
    # opmd: r - mean (1.0): [1, 0, -1]; only the 2.0 is a full success and gets alpha.
    assert per_row_advantage(experience) == pytest.approx([3.0, 0.0, -1.0])
    assert experience.behaviour == ["sampled", "sampled", "pinned"]
