"""R³'s ranking of a step's failures from the trainer's entropies: who is ranked, the tiers, the figures."""

import math

import pytest
import torch

from r3lightning.algos.objective import RankingConfig
from r3lightning.data.failure_ranking import failure_tier, rank_failures
from r3lightning.types import Group, Trajectory, Turn


def traj(reward: float, tokens: int, truncated: bool = False, rejected: int = 0) -> Trajectory:
    return Trajectory("t", [Turn([1, 2], list(range(3, 3 + tokens)))], reward=reward, truncated=truncated, rejected_actions=rejected)


def entropy_rows(profiles: list[list[float]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    entropy, mask = torch.zeros(len(profiles), width), torch.zeros(len(profiles), width)
    for i, p in enumerate(profiles):
        entropy[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1.0
    return entropy, mask


def test_tiers_put_unreadable_failures_below_readable_and_truncated_ones():
    assert failure_tier(traj(0.0, 3)) == 1
    assert failure_tier(traj(0.0, 3, truncated=True, rejected=1)) == 1
    assert failure_tier(traj(0.0, 3, rejected=1)) == 0


def test_rows_that_never_generated_get_no_bonus_and_successes_keep_their_advantage():
    group = Group("t", [traj(1.0, 4), traj(0.0, 0), traj(0.0, 4), traj(0.0, 4)])
    entropy, mask = entropy_rows([[0.1] * 4, [], [0.1, 2.0, 0.1, 0.1], [0.1] * 4], width=5)
    advantages = torch.tensor([1.5, -0.5, -0.5, -0.5])
    cfg = RankingConfig(enabled=True, top_k=1, window=2, delta=0.2)
    adjusted, activity = rank_failures([group], advantages, entropy, mask, cfg, max_reward=1.0)
    # ranked: rows 2 (the fork at 2.0 ranks first) and 3; the empty row 1 is left alone
    assert adjusted.tolist() == pytest.approx([1.5, -0.5, -0.4, -0.6])
    assert activity.ranked == 2 and activity.capped == 0
    assert activity.bonus_abs_mean == pytest.approx(0.1)


def test_a_ranking_that_follows_length_shows_in_its_correlation():
    # one all-fail group whose entropy rises with length: longer ranks higher, correlation +1
    lengths = [2, 3, 4, 5, 6]
    group = Group("t", [traj(0.0, n) for n in lengths])
    entropy, mask = entropy_rows([[float(n)] * n for n in lengths], width=6)
    cfg = RankingConfig(enabled=True, top_k=2, window=1, delta=0.2)
    _, activity = rank_failures([group], torch.zeros(5), entropy, mask, cfg, max_reward=1.0)
    assert activity.length_corr == pytest.approx(1.0)
    assert activity.metrics()["activity/ranking_length_corr"] == pytest.approx(1.0)
    # a constant profile: every failure level, no bonus, no correlation to report
    entropy, mask = entropy_rows([[1.0] * n for n in lengths], width=6)
    adjusted, activity = rank_failures([group], torch.zeros(5), entropy, mask, cfg, max_reward=1.0)
    assert adjusted.tolist() == pytest.approx([0.0] * 5) and math.isnan(activity.length_corr)
    assert "activity/ranking_length_corr" not in activity.metrics()
