"""Levers the ranking of failures must not have (issue 62, science review of 2026-12-07 §1).

Each test is a hand-built all-fail or mixed group run through ``rank_failures`` (the step's ranking from
the trainer's entropies): length must not move the bonus at any monotone entropy profile, a response
shorter than ``top_k`` or one window is not scored on a scale it lacks, truncation does not lift an
unreadable answer, and no failure's advantage exceeds any success's of the step, whatever the estimator.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.algos.advantages import compute_advantages
from r3lightning.algos.objective import AlgorithmConfig, RankingConfig
from r3lightning.data.experience import make_experience
from r3lightning.data.failure_ranking import failure_tier, rank_failed_rows, rank_failures
from r3lightning.data.step_rollout import StepRollout
from r3lightning.rollout.explorers.base import Exploration
from r3lightning.types import Group, Trajectory, Turn

R3 = RankingConfig(enabled=True, top_k=2, window=4, weight_local=1.0, weight_global=1.0, delta=0.2)


def traj(reward: float, tokens: int, truncated: bool = False, rejected: int = 0) -> Trajectory:
    return Trajectory("t", [Turn([1, 2], list(range(3, 3 + tokens)))], reward=reward, truncated=truncated,
                      rejected_actions=rejected)


def entropy_rows(profiles: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in profiles)
    entropy, mask = torch.zeros(len(profiles), width), torch.zeros(len(profiles), width)
    for i, p in enumerate(profiles):
        entropy[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1.0
    return entropy, mask


def bonuses(profiles: list[list[float]], cfg: RankingConfig = R3, **traj_kwargs) -> list[float]:
    """The ranking bonus of an all-fail group of readable answers with these entropy profiles."""
    group = Group("t", [traj(0.0, len(p), **traj_kwargs) for p in profiles])
    entropy, mask = entropy_rows(profiles)
    adjusted, _ = rank_failures([group], torch.zeros(len(profiles)), entropy, mask, cfg, max_reward=1.0)
    return adjusted.tolist()


FALLING = [2.0, 1.6, 1.2, 0.9, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1]


@pytest.mark.parametrize("profile", [FALLING, FALLING[::-1]], ids=["falling", "rising"])
def test_prefixes_of_one_profile_all_tie(profile):
    # The review's case (ii): lengths 1..12 cut from one profile gave rank-length correlation -1.0
    # (falling) and +0.998 (rising). Every pair agrees on the tokens both have, so no length wins.
    assert bonuses([profile[:n] for n in range(1, 13)]) == pytest.approx([0.0] * 12)


@settings(deadline=None, max_examples=60)
@given(
    steps=st.lists(st.floats(0.0, 1.0), min_size=12, max_size=12),
    start=st.floats(0.0, 3.0),
    rising=st.booleans(),
    lengths=st.lists(st.integers(1, 12), min_size=2, max_size=8),
    top_k=st.integers(1, 3),
    window=st.integers(1, 4),
)
def test_no_length_lever_at_any_monotone_profile(steps, start, rising, lengths, top_k, window):
    values, level = [], start
    for step in steps:
        values.append(level)
        level = level + step if rising else max(level - step, 0.0)
    cfg = RankingConfig(enabled=True, top_k=top_k, window=window, delta=0.2)
    assert bonuses([values[:n] for n in lengths], cfg) == pytest.approx([0.0] * len(lengths))


def test_a_one_token_answer_is_not_scored_on_its_one_entropy():
    # The review's case (ii-a): below top_k the local score averaged the answer's one token, its
    # highest entropy, and the 1-token answer ranked first. It has no top-2 and no two windows: it is
    # compared with nobody, so it sits at the middle rank, bonus 0, whatever that entropy is.
    others = [[0.3, 0.2, 0.9, 0.1, 0.4, 0.2, 0.3, 0.1], [0.5, 0.1, 0.1, 0.8, 0.2, 0.6, 0.1, 0.1],
              [0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]]
    for entropy in (5.0, 0.01):
        result = bonuses([[entropy]] + others)
        assert result[0] == pytest.approx(0.0)
        assert sum(result) == pytest.approx(0.0)


def test_an_answer_shorter_than_one_window_is_not_scored_on_the_others_stability():
    # The review's case (iii-a): a 3-token answer took its group's mean stability and its place was
    # decided by how stable the *other* answers were. It shares its first three tokens with each of
    # them, so it ties with each: its bonus does not depend on their tails.
    head = [0.9, 0.1, 0.5]
    for tails in ([[0.1, 0.1, 0.1, 0.1, 0.1], [2.0, 0.1, 3.0, 0.1, 0.1]], [[3.0, 3.0, 3.0, 3.0, 3.0], [0.1] * 5]):
        result = bonuses([head] + [head + tail for tail in tails])
        assert result[0] == pytest.approx(0.0)


def test_truncation_alone_does_not_lift_an_unreadable_answer():
    # The review's case (i-c): an unreadable ramble cut at the length cap was tier 1, above an
    # unreadable empty box (tier 0). Readability decides the tier; truncation does not.
    assert failure_tier(traj(0.0, 8, truncated=True, rejected=1)) == 0
    assert failure_tier(traj(0.0, 8, truncated=True)) == 1
    flat = [0.8] * 8
    group = Group("t", [traj(0.0, 8, truncated=True, rejected=1), traj(0.0, 5, rejected=1), traj(0.0, 8), traj(0.0, 8)])
    entropy, mask = entropy_rows([flat, flat[:5], flat, flat])
    adjusted, _ = rank_failures([group], torch.zeros(4), entropy, mask, R3, max_reward=1.0)
    # two unreadable ones level at the bottom (mean of ranks 0 and 1), two readable ones level at the top
    assert adjusted.tolist() == pytest.approx([-0.2 / 3, -0.2 / 3, 0.2 / 3, 0.2 / 3])


def _mixed_step(group_size: int, successes: list[int]) -> tuple[list[Group], torch.Tensor, torch.Tensor]:
    """Groups of ``group_size`` with the given success counts; failures' entropies all differ."""
    groups, profiles = [], []
    generator = torch.Generator().manual_seed(0)
    for k in successes:
        groups.append(Group("t", [traj(1.0, 8) for _ in range(k)] + [traj(0.0, 8) for _ in range(group_size - k)]))
        profiles += torch.rand(group_size, 8, generator=generator).tolist()
    entropy, mask = entropy_rows(profiles)
    return groups, entropy, mask


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "opmd", "reinforce", "raft"])
@pytest.mark.parametrize("group_size", [8, 16])
def test_no_failure_out_advantages_a_success_of_another_group(estimator, group_size):
    # The review's case (iv): with dr_grpo or rloo at N = 16 a success of a 15/16 group gets +0.062 /
    # +0.067 and the best-ranked failure of an all-fail group +0.100. The cap is the step's lowest
    # success advantage, not the group's.
    groups, entropy, mask = _mixed_step(group_size, [group_size - 1, 0, 1, group_size // 2])
    rewards = torch.tensor([t.reward for g in groups for t in g.trajectories])
    index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories])
    advantages = compute_advantages(rewards, index, estimator)
    adjusted, _ = rank_failures(groups, advantages, entropy, mask, R3, max_reward=1.0)
    success = rewards >= 1.0
    assert float(adjusted[~success].max()) <= float(adjusted[success].min()) + 1e-9


@settings(deadline=None, max_examples=80)
@given(
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    group_size=st.integers(2, 16),
    counts=st.lists(st.integers(0, 16), min_size=1, max_size=5),
    delta=st.floats(0.0, 3.0),
    seed=st.integers(0, 1000),
)
def test_the_cap_holds_across_groups_for_every_group_size(estimator, group_size, counts, delta, seed):
    counts = [min(c, group_size) for c in counts]
    groups, _, _ = _mixed_step(group_size, counts)
    profiles = torch.rand(group_size * len(counts), 8, generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(profiles)
    rewards = torch.tensor([t.reward for g in groups for t in g.trajectories])
    index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.trajectories])
    cfg = RankingConfig(enabled=True, top_k=2, window=4, delta=delta)
    adjusted, _ = rank_failures(groups, compute_advantages(rewards, index, estimator), profiles, mask, cfg, 1.0)
    success = rewards >= 1.0
    if success.any() and (~success).any():
        assert float(adjusted[~success].max()) <= float(adjusted[success].min()) + 1e-9


def test_the_batch_is_ranked_from_the_advantages_make_experience_computed():
    # Computed once: ranking with another estimator named in the objective it is handed changes nothing,
    # because it reads the advantages the batch already holds.
    group = Group("t", [traj(1.0, 4), traj(0.0, 4), traj(0.0, 4), traj(0.0, 4)])
    grpo = AlgorithmConfig(advantage="grpo", ranking=RankingConfig(enabled=True, top_k=1, window=1, delta=0.2))
    entropy = torch.tensor([[0.0, 0.1, 0.1, 0.1, 0.1], [0.0, 0.1, 2.0, 0.1, 0.1], [0.0, 0.3, 0.3, 0.3, 0.3],
                            [0.0, 0.5, 0.1, 0.1, 0.1]])
    outcomes = []
    for handed in (grpo, AlgorithmConfig(advantage="reinforce", ranking=grpo.ranking)):
        experience, _ = make_experience(StepRollout(Exploration([group])), grpo, pad_token_id=0)
        rank_failed_rows(experience, [group], entropy, handed, max_reward=1.0)
        outcomes.append(experience.advantages.clone())
    assert torch.equal(outcomes[0], outcomes[1])
