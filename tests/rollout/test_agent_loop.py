"""Agent loop: batched multi-turn play with exact token bookkeeping."""

import pytest
import torch
from hanging_suite import HangingSuite

from r3lightning.data.collate import collate_experience
from r3lightning.rollout.agent_loop import (
    AgentLoop,
    AgentLoopConfig,
    EpisodeRequest,
    parse_action,
    render_action,
)
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine


class RecordingEngine:
    """Wraps an engine and records every prompt and generation it served."""

    def __init__(self, inner):
        self.inner, self.calls, self.weight_version = inner, [], 0

    def generate(self, prompts, params):
        out = self.inner.generate(prompts, params)
        self.calls.append((prompts, out))
        return out


def test_parse_action_formats():
    tag = AgentLoopConfig(action_format="tag")
    assert parse_action("think <action> take apple </action> more", tag) == "take apple"
    assert parse_action("no tag here", tag) is None
    assert parse_action("<action>  </action>", tag) is None
    assert parse_action("\n\n go to kitchen\nextra", AgentLoopConfig(action_format="line")) == "go to kitchen"
    assert parse_action("x = 3\n\\boxed{3}", AgentLoopConfig(action_format="raw")) == "x = 3\n\\boxed{3}"


def test_multi_turn_tokens_are_exactly_the_engines(world_suite, world_tokenizer, world_policy):
    torch.manual_seed(0)
    engine = RecordingEngine(HFEngine(world_policy, world_tokenizer))
    loop = AgentLoop(world_suite, engine, world_tokenizer, AgentLoopConfig(max_context_tokens=1024))
    tasks = [world_suite.train_task(i) for i in range(3)]
    trajectories = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(2)], SamplingParams(max_new_tokens=12))
    served = {}
    for prompts, gens in engine.calls:
        for prompt, gen in zip(prompts, gens):
            served.setdefault(tuple(prompt), []).append(gen)
    assert any(len(t.turns) > 1 for t in trajectories), "a random policy should need several turns"
    for traj in trajectories:
        for i, turn in enumerate(traj.turns):
            # The engine was asked with exactly this context and returned exactly these tokens.
            candidates = served[tuple(traj.context_of(i))]
            assert any(g.token_ids == turn.response_ids and g.logprobs == turn.logprobs for g in candidates)


def test_batching_one_engine_call_per_turn(world_suite, world_tokenizer, world_policy):
    engine = RecordingEngine(HFEngine(world_policy, world_tokenizer))
    loop = AgentLoop(world_suite, engine, world_tokenizer)
    loop.run([EpisodeRequest(task=world_suite.train_task(i)) for i in range(6)], SamplingParams(max_new_tokens=8))
    assert len(engine.calls) <= world_suite.max_turns
    assert len(engine.calls[0][0]) == 6


def test_loss_mask_covers_assistant_tokens_only(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    trajectories = loop.run([EpisodeRequest(task=world_suite.train_task(i)) for i in range(3)], SamplingParams(max_new_tokens=8))
    batch = collate_experience(trajectories, [1.0] * 3, world_tokenizer.pad_token_id, pivotal_credit=False)
    for row, traj in enumerate(trajectories):
        expected = []
        for turn in traj.turns:
            expected += [0] * len(turn.context_ids) + [1] * len(turn.response_ids)
        n = len(expected)
        assert batch.loss_mask[row, :n].int().tolist() == expected
        assert batch.loss_mask[row, n:].sum() == 0
        assert batch.input_ids[row, :n].tolist() == traj.token_ids()


def test_retry_from_prefix_shows_pivot_observation_once_with_guidance(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    task = world_suite.train_task(0)
    first = loop.play_actions([EpisodeRequest(task=task)], [["look"] * 4])[0]
    retry = loop.run(
        [EpisodeRequest(task=task, prefix=first.turns[:1], guidance="Take the object first.")],
        SamplingParams(max_new_tokens=8),
    )[0]
    assert retry.turns[0] is first.turns[0]
    pivot_context = world_tokenizer.decode(retry.turns[1].context_ids)
    assert pivot_context.count("Valid actions") == 1
    assert "Take the object first." in pivot_context
    turn_index, unguided = retry.guided_turn.index, retry.guided_turn.unguided_context
    assert turn_index == 1
    assert "Take the object first." not in world_tokenizer.decode(unguided)
    assert world_tokenizer.decode(unguided) == world_tokenizer.decode(first.turns[1].context_ids)
    for later in retry.turns[2:]:
        assert "Take the object first." not in world_tokenizer.decode(later.context_ids)


def test_context_limit_truncates(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer, AgentLoopConfig(max_context_tokens=120))
    trajectories = loop.run([EpisodeRequest(task=world_suite.train_task(0))], SamplingParams(max_new_tokens=40))
    traj = trajectories[0]
    assert traj.truncated and traj.end_reason == "context_limit"
    assert len(traj.token_ids()) <= 120


def test_invalid_action_end_mode(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer, AgentLoopConfig(invalid_action="end"))
    traj = loop.run_scripted([EpisodeRequest(task=world_suite.train_task(0))], [[world_tokenizer("no tags")["input_ids"]]])[0]
    assert traj.end_reason == "invalid_action" and traj.reward == 0.0 and len(traj.turns) == 1


def test_invalid_action_feedback_mode_continues(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    bad = world_tokenizer("no tags")["input_ids"]
    traj = loop.run_scripted([EpisodeRequest(task=world_suite.train_task(0))], [[bad] * 4])[0]
    assert traj.invalid_actions == 4 and traj.end_reason == "max_turns"
    assert "Invalid action format" in world_tokenizer.decode(traj.turns[1].context_ids)


def test_invalid_action_penalty_counts_malformed_and_rejected_actions(world_suite, world_tokenizer, world_policy):
    config = AgentLoopConfig(invalid_action_penalty=0.1)
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer, config)
    task = world_suite.train_task(0)

    def rendered(action):
        return world_tokenizer(render_action(action, config), add_special_tokens=False)["input_ids"] + [world_tokenizer.eos_token_id]

    malformed = world_tokenizer("no tags")["input_ids"]
    script = [malformed, rendered("take unicorn"), *(rendered(a) for a in world_suite.demonstration(task))]
    traj = loop.run_scripted([EpisodeRequest(task=task)], [script])[0]
    assert traj.success and traj.reward == pytest.approx(1.0 - 2 * 0.1)
    assert traj.invalid_actions == 1 and traj.rejected_actions == 1
    # A retry that replays both bad turns as its prefix pays for them too.
    retry = loop.run_scripted([EpisodeRequest(task=task, prefix=traj.turns[:2])], [script[2:]])[0]
    assert retry.success and retry.reward == pytest.approx(0.8)
    clean = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    assert clean.run_scripted([EpisodeRequest(task=task)], [script])[0].reward == 1.0
    with pytest.raises(ValueError, match="invalid_action_penalty"):
        AgentLoopConfig(invalid_action_penalty=-0.1)


def test_hanging_environment_step_is_cut_and_masked(world_tokenizer, world_policy):
    suite = HangingSuite()
    loop = AgentLoop(suite, HFEngine(world_policy, world_tokenizer), world_tokenizer, AgentLoopConfig(action_format="raw", step_timeout_s=0.2))
    traj = loop.run([EpisodeRequest(task=suite.train_task(1))], SamplingParams(max_new_tokens=4))[0]  # odd: hangs
    assert traj.reward_error and traj.end_reason == "env_error" and traj.reward == 0.0


def test_math_with_attempts_is_a_multi_turn_episode(world_tokenizer, world_policy):
    from r3lightning.envs.math_env import MathSuite

    suite = MathSuite(source="arithmetic", max_attempts=3, num_val_tasks=2, instruction="")
    task = suite.train_task(0)
    loop = AgentLoop(suite, HFEngine(world_policy, world_tokenizer), world_tokenizer, AgentLoopConfig(action_format="raw"))
    wrong = f"\\boxed{{{int(task.answer) + 1}}}"
    traj = loop.play_actions([EpisodeRequest(task=task)], [[wrong, wrong, f"\\boxed{{{task.answer}}}"]])[0]
    assert traj.success and traj.reward == 1.0 and len(traj.turns) == 3
    assert "Incorrect, try again." in world_tokenizer.decode(traj.turns[1].context_ids)
    failed = loop.play_actions([EpisodeRequest(task=task)], [[wrong] * 3])[0]
    assert not failed.success and failed.reward == 0.0 and len(failed.turns) == 3
