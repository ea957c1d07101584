"""R³'s ranking of a step's failures from the trainer's entropies: who is ranked, the tiers, the figures."""

import math

import pytest
import torch

from r3lightning.algos.objective import AlgorithmConfig, RankingConfig
from r3lightning.data.collate import collate_experience
from r3lightning.data.experience import make_experience
from r3lightning.data.failure_ranking import failure_tier, rank_failed_rows, rank_failures
from r3lightning.data.step_rollout import StepRollout
from r3lightning.rollout.explorers.base import Exploration
from r3lightning.types import Group, Trajectory, Turn


def traj(reward: float, tokens: int, truncated: bool = False, rejected: int = 0) -> Trajectory:
    return Trajectory("t", [Turn([1, 2], list(range(3, 3 + tokens)))], reward=reward, truncated=truncated, rejected_actions=rejected)


def entropy_rows(profiles: list[list[float]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    entropy, mask = torch.zeros(len(profiles), width), torch.zeros(len(profiles), width)
    for i, p in enumerate(profiles):
        entropy[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1.0
    return entropy, mask


def test_tiers_put_unreadable_failures_below_readable_ones_truncated_or_not():
    assert failure_tier(traj(0.0, 3)) == 1
    assert failure_tier(traj(0.0, 3, truncated=True)) == 1
    assert failure_tier(traj(0.0, 3, truncated=True, rejected=1)) == 0
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


def test_the_collated_batch_gets_the_bonus_on_its_rl_rows_only():
    """The ranking reads the RL rows of the batch the step trains on (no second collation: those rows,
    trimmed, are what collating them alone gives) and writes their advantages there; the SFT row, wider
    than every RL row, keeps its own; a truncated failure's masked tokens stay 0."""
    group = Group("t", [traj(1.0, 4), traj(0.0, 4), traj(0.0, 2), traj(0.0, 3, truncated=True)])
    sft = Trajectory("t", [Turn([1, 2], list(range(3, 12)))], reward=1.0, origin="reflect_sft")
    objective = AlgorithmConfig(advantage="opmd", mask_truncated=True, ranking=RankingConfig(enabled=True, top_k=1, window=1, delta=0.2))
    experience, _ = make_experience(StepRollout(Exploration([group], sft=[sft])), objective, pad_token_id=0)
    rows = experience.slice(0, 4)
    alone = collate_experience(group.trajectories, [0.0] * 4, 0, pivotal_credit=False)
    assert rows.input_ids.shape[1] < experience.input_ids.shape[1]
    assert torch.equal(rows.input_ids, alone.input_ids) and torch.equal(rows.turn_index, alone.turn_index)
    entropy, _ = entropy_rows([[0.1] * 4, [0.1, 2.0, 0.1, 0.1], [0.1] * 2, [0.1] * 3], width=4)
    entropy = torch.cat([torch.zeros(4, 1), entropy], dim=1)  # prediction 0 reads a prompt token
    sft_before = experience.advantages[4].clone()
    activity = rank_failed_rows(experience, [group], entropy, objective, max_reward=1.0)
    adjusted, expected_activity = rank_failures(
        [group], torch.tensor([0.75, -0.25, -0.25, -0.25]), entropy, (alone.turn_index[:, 1:] >= 0).float(), objective.ranking, 1.0
    )
    assert experience.advantages[:4].tolist() == (adjusted.unsqueeze(1) * experience.loss_mask[:4]).tolist()
    assert adjusted[1] > -0.25 and experience.advantages[3].abs().sum() == 0  # the fork ranks first; truncated: masked
    assert torch.equal(experience.advantages[4], sft_before)
    assert activity.metrics() == expected_activity.metrics() and activity.ranked == 3


def credited(reward: float, tokens: int, credit) -> Trajectory:
    t = traj(reward, tokens)
    t.partial_credit = credit
    return t


def test_the_premise_gate_correlates_the_bonus_with_closeness_to_success():
    # Four readable wrong answers whose entropy fork falls as they come closer to the reference: the
    # entropy order is the reverse of closeness, the gate reads -1. An answer without a credit (one the
    # environment could not compare) is ranked but left out of the gate.
    group = Group("t", [credited(0.0, 4, c) for c in (0.1, 0.2, 0.5, 1 / 3)] + [credited(0.0, 4, None)])
    entropy, mask = entropy_rows([[0.1, 3.0, 0.1, 0.1], [0.1, 2.0, 0.1, 0.1], [0.1, 0.5, 0.1, 0.1],
                                  [0.1, 1.0, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]], width=4)
    cfg = RankingConfig(enabled=True, top_k=1, window=4, delta=0.2)
    _, activity = rank_failures([group], torch.zeros(5), entropy, mask, cfg, max_reward=1.0)
    # bonus ranks 4, 3, 0, 2 of the credited ones (the uncredited one is rank 1), credits 0.1, 0.2, 0.5, 1/3
    bonus = torch.tensor([4.0, 3.0, 0.0, 2.0]) * 0.05 - 0.1
    credit = torch.tensor([0.1, 0.2, 0.5, 1 / 3], dtype=torch.float64)
    b, c = bonus.double() - bonus.double().mean(), credit - credit.mean()
    assert activity.credit_corr == pytest.approx(float((b * c).sum() / (b.norm() * c.norm())))
    assert activity.credit_corr < -0.9 and activity.credit_samples == 4
    assert activity.metrics()["activity/ranking_credit_corr"] == pytest.approx(activity.credit_corr)


def test_the_placebo_orders_at_random_and_the_length_control_shorter_first():
    lengths = [5, 3, 8, 6, 4, 7]
    group = Group("t", [traj(0.0, n) for n in lengths])
    entropy, mask = entropy_rows([[1.0] * n for n in lengths], width=8)  # the entropy order: all tie
    by_length, activity = rank_failures([group], torch.zeros(6), entropy, mask, RankingConfig(enabled=True, order="length"), 1.0)
    assert by_length.tolist() == pytest.approx([0.2 * (r / 5 - 0.5) for r in (3, 5, 0, 2, 4, 1)])
    assert activity.length_corr == pytest.approx(-1.0)
    placebo = RankingConfig(enabled=True, order="placebo")
    draws = [rank_failures([group], torch.zeros(6), entropy, mask, placebo, 1.0, torch.Generator().manual_seed(s))[0]
             for s in (0, 0, 1)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])  # seeded, and a real draw
    for bonus in draws:  # a permutation of the same centred bonus
        assert sorted(bonus.tolist()) == pytest.approx(sorted(by_length.tolist()))
    with pytest.raises(ValueError, match="placebo' needs a generator"):
        rank_failures([group], torch.zeros(6), entropy, mask, placebo, 1.0)


def test_the_control_presets_are_r3_but_for_the_order():
    import yaml
    from pathlib import Path

    presets = Path(__file__).resolve().parents[2] / "configs" / "algorithms"
    r3 = yaml.safe_load((presets / "r3.yaml").read_text())
    assert r3["model"]["algorithm"]["ranking"]["order"] == "entropy"
    for order in ("placebo", "length"):
        control = yaml.safe_load((presets / f"r3_ranking_{order}.yaml").read_text())
        assert control["model"]["algorithm"]["ranking"].pop("order") == order
        expected = yaml.safe_load((presets / "r3.yaml").read_text())
        expected["model"]["algorithm"]["ranking"].pop("order")
        assert control == expected
