"""R³ cross-context replay as the datamodule applies it: flat groups rescued from the buffer, the
buffer's per-outcome bounds, re-rendering under a changed template, and replayed rows' log-probs."""

import random

import pytest
import torch

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.data.experience import make_experience
from r3lightning.data.step_rollout import StepRollout
from r3lightning.data.replay import ReplayBuffer, ReplayConfig, record_step, replay_into_groups
from r3lightning.rollout.agent_loop import AgentLoop
from r3lightning.rollout.explorers.base import Exploration
from r3lightning.types import Group, Trajectory, Turn


def traj(task, success, logprob=-0.5, pivot=None):
    return Trajectory(task, [Turn([1, 2], [3, 4], [logprob, logprob])], reward=float(success), success=success, pivot=pivot)


def test_an_all_fail_group_gets_a_stored_success_and_its_gap_back():
    buffer, config = ReplayBuffer(4, 100), ReplayConfig(enabled=True, k=1)
    record_step([Group("a", [traj("a", True, logprob=-3.0, pivot=1), traj("a", False)])], buffer, step=0)
    groups = [Group("a", [traj("a", False), traj("a", False)]), Group("b", [traj("b", False), traj("b", False)])]
    figures = replay_into_groups(groups, buffer, config, step=5, max_reward=1.0, rng=random.Random(0))
    replayed = groups[0].trajectories[-1]
    assert replayed.origin == "replay" and replayed.success and replayed.pivot is None
    assert replayed.turns[0].logprobs == [-3.0, -3.0]  # the behaviour log-probs of the policy that sampled it
    assert len(groups[1]) == 2  # task b has no stored success
    assert figures["train/zero_variance_group_rate_before_replay"] == 1.0
    assert figures["replay/rescued_group_rate"] == 0.5 and figures["replay/hit_rate"] == 0.5
    assert figures["replay/age_steps"] == 5.0 and figures["replay/injected"] == 1.0
    # This step's fresh samples were stored after the replay: 2 of task a's... the bound per outcome is 4.
    assert figures["replay/size"] == len(buffer) == 2 + 4 and figures["replay/bytes"] == buffer.num_bytes()


def test_a_group_never_replays_its_own_samples_and_success_groups_only_on_request():
    buffer = ReplayBuffer(4, 100)
    groups = [Group("a", [traj("a", False), traj("a", False)])]
    replay_into_groups(groups, buffer, ReplayConfig(enabled=True), step=0, max_reward=1.0, rng=random.Random(0))
    assert [t.origin for t in groups[0]] == ["base", "base"]
    record_step([Group("a", [traj("a", False)])], buffer, step=1)
    solved = [Group("a", [traj("a", True), traj("a", True)])]
    replay_into_groups(solved, buffer, ReplayConfig(enabled=True), step=2, max_reward=1.0, rng=random.Random(0))
    assert len(solved[0]) == 2
    replay_into_groups(solved, buffer, ReplayConfig(enabled=True, into_all_success=True), step=3, max_reward=1.0, rng=random.Random(0))
    assert solved[0].trajectories[-1].origin == "replay" and not solved[0].trajectories[-1].success


def test_max_age_keeps_stale_trajectories_out():
    buffer = ReplayBuffer(4, 100)
    record_step([Group("a", [traj("a", True)])], buffer, step=0)
    groups = [Group("a", [traj("a", False), traj("a", False)])]
    figures = replay_into_groups(groups, buffer, ReplayConfig(enabled=True, max_age_steps=3), step=10, max_reward=1.0, rng=random.Random(0))
    assert len(groups[0]) == 2 and figures["replay/hit_rate"] == 0.0


def test_a_tasks_only_success_survives_many_failures():
    buffer = ReplayBuffer(max_per_task=2, max_total=100)
    buffer.add(traj("a", True), step=0)
    for step in range(1, 20):
        buffer.add(traj("a", False), step=step)
    assert len(buffer.sample("a", want_success=True, k=1, rng=random.Random(0))) == 1
    assert len(buffer.sample("a", want_success=False, k=5, rng=random.Random(0))) == 2


def test_stored_trajectories_are_re_rendered_under_a_changed_template(world_suite, world_tokenizer, world_policy):
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.rollout.agent_loop import EpisodeRequest

    task = world_suite.train_task(0)
    old = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    played = old.play_actions([EpisodeRequest(task=task)], [["look", "look"]], allow_unfinished=True)[0]
    assert old.rerender(played) is played  # same template: nothing to do

    other = type(world_suite)(difficulty=1, num_val_tasks=8, max_turns=4)
    other.system_prompt = "You are a careful household robot."
    new = AgentLoop(other, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    rendered = new.rerender(played)
    assert rendered.turns[0].context_ids == new.chat.first_prompt(played.turns[0].observation)
    assert rendered.turns[0].context_ids != played.turns[0].context_ids
    assert [t.response_ids for t in rendered.turns] == [t.response_ids for t in played.turns]
    assert world_tokenizer.decode(rendered.turns[1].context_ids) == world_tokenizer.decode(played.turns[1].context_ids)


def test_replayed_rows_keep_their_stored_behaviour_and_get_the_ratio_against_it(world_tokenizer, world_policy):
    from r3lightning.module import R3LightningModule

    ids = world_tokenizer("Compute 2+3. 5", add_special_tokens=False)["input_ids"]
    fresh = Trajectory("a", [Turn(ids[:3], ids[3:], [-1.0] * len(ids[3:]))], reward=0.0)
    replayed = Trajectory("a", [Turn(ids[:3], ids[3:], [-4.0] * len(ids[3:]))], reward=1.0, success=True, origin="replay")
    exploration = Exploration([Group("a", [fresh, replayed])])
    experience, _ = make_experience(StepRollout(exploration), AlgorithmConfig(policy_loss="ppo_clip"), world_tokenizer.pad_token_id)
    assert experience.behaviour == ["sampled", "stored"]
    pinned, _ = make_experience(StepRollout(exploration, replay_behaviour="pinned"), AlgorithmConfig(), world_tokenizer.pad_token_id)
    assert pinned.behaviour == ["sampled", "pinned"]

    module = R3LightningModule(algorithm=AlgorithmConfig(policy_loss="ppo_clip"))
    module.policy, module.tokenizer = world_policy, world_tokenizer
    mask = experience.loss_mask[:, 1:]
    totals = {"rl_tokens": float(mask.sum()), "rl_seqs": 2.0, "sft_tokens": 0.0, "sft_seqs": 0.0}
    out = module.micro_batch_loss(experience, totals)
    with torch.no_grad():
        logp = module.prefix_forward.sequence_logprobs(world_policy, experience).logp
        ratio = torch.exp(logp - experience.old_logprobs[:, 1:])
    torch.testing.assert_close(out["ratio_sum"], (ratio * mask).sum())
    assert torch.all(experience.old_logprobs[1, 1:][mask[1].bool()] == -4.0)  # the stored ones, not the current policy's
    out_pinned = module.micro_batch_loss(pinned, totals)
    assert out_pinned["ratio_count"] == mask[0].sum()  # the pinned replay row has no ratio
