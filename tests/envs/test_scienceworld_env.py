"""ScienceWorld suite (JVM simulator) through the agent loop: gold demonstrations, failures, splits.

One task (``find-living-thing``, gold paths of 10-12 actions) keeps the module to a few JVM starts.
"""

import gc
import sys

import pytest
import torch

from r3lightning.data.datamodule import corpus_from_suite
from r3lightning.models import TinyModelSpec, build_tiny_model, build_tokenizer
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.rollout.engine import SamplingParams
from r3lightning.rollout.hf_engine import HFEngine

SPEC = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=400)
TASK = "find-living-thing"


@pytest.fixture(scope="module")
def suite():
    pytest.importorskip("scienceworld")
    from r3lightning.envs.scienceworld_env import ScienceWorldSuite

    try:
        suite = ScienceWorldSuite(task_names=[TASK], num_val_per_task=1)
    except RuntimeError as err:  # no Java on this machine
        pytest.skip(str(err))
    yield suite
    suite.close()


@pytest.fixture(scope="module")
def tokenizer(suite):
    return build_tokenizer(corpus_from_suite(suite, AgentLoopConfig(), num_tasks=1), vocab_size=SPEC.vocab_size)


@pytest.fixture(scope="module")
def loop(suite, tokenizer):
    model = build_tiny_model(SPEC, tokenizer, seed=0)
    return AgentLoop(suite, HFEngine(model, tokenizer), tokenizer, AgentLoopConfig(max_context_tokens=8192))


def test_splits_follow_the_package_variations(suite):
    variations = suite.variations[TASK]
    assert variations["train"] and variations["dev"] and variations["test"]
    assert set(variations["train"]).isdisjoint(variations["dev"])
    train = [suite.train_task(i) for i in range(5)]
    assert all(t.data["variation"] in variations["train"] and t.data["task_name"] == TASK for t in train)
    val = suite.val_tasks()
    assert [t.data["variation"] for t in val] == variations["dev"][:1]
    assert suite.max_turns == 30
    assert len({t.task_id for t in train}) == 5  # one shuffled pass over 150 training variations


def test_gold_demonstration_succeeds_through_the_loop(suite, loop):
    tasks = [suite.train_task(0)] + suite.val_tasks()
    demos = [suite.demonstration(t) for t in tasks]
    assert all(demos) and all(len(d) <= suite.max_turns for d in demos)
    played = loop.play_actions([EpisodeRequest(task=t, origin="demo") for t in tasks], demos)
    for traj, demo in zip(played, demos):
        assert traj.success and traj.reward == 1.0 and traj.actions == demo
        assert traj.end_reason == "done"
    first = loop.tokenizer.decode(played[0].turns[0].context_ids)
    assert "Your task is to find a(n) living thing" in first and "This room is called" in first


def test_reward_is_clipped_score_and_failure_ends_the_episode(suite):
    task = suite.train_task(0)
    demo = suite.demonstration(task)
    env = suite.make_env()
    env.reset(task)
    rewards = []
    for action in demo[:-1]:
        result = env.step(action)
        assert not result.done
        assert result.reward == result.info["score"] / 100
        rewards.append(result.reward)
    assert rewards == sorted(rewards) and 0.0 < rewards[-1] < 1.0  # partial credit, never decreasing here

    unknown = suite.make_env()
    unknown.reset(task)
    bad = unknown.step("juggle the moon")
    assert bad.info["invalid_action"] and not bad.done and bad.reward == 0.0
    failed = unknown.step("focus on agent")  # focusing on a wrong object: score -100
    assert failed.done and not failed.info["success"] and failed.info["score"] < 0 and failed.reward == 0.0
    assert failed.observation.endswith("The task failed.")


def test_step_limit_and_valid_action_listing(suite):
    from r3lightning.envs.scienceworld_env import ScienceWorldSuite

    listing = ScienceWorldSuite(task_names=[TASK], max_turns=2, list_valid_actions=True)
    try:
        env = listing.make_env()
        first = env.reset(suite.train_task(0))
        valid_line = first.splitlines()[-1]
        assert valid_line.startswith("Valid actions: ") and "look around" in valid_line
        step = env.step("look around")
        assert not step.done and "look around" in step.info["admissible_actions"]
        assert step.observation.splitlines()[-1] == f"Valid actions: {', '.join(step.info['admissible_actions'])}."
        last = env.step("wait1")
        assert last.done and not last.info["success"] and last.observation.endswith("You have run out of turns.")
        assert last.info["admissible_actions"] == []
    finally:
        listing.close()


def test_random_model_plays_episodes_through_the_loop(suite, tokenizer, loop):
    torch.manual_seed(0)
    task = suite.train_task(0)
    small = AgentLoop(suite, loop.engine, tokenizer, AgentLoopConfig(max_context_tokens=640))
    trajectories = small.run([EpisodeRequest(task=task) for _ in range(2)], SamplingParams(max_new_tokens=8))
    assert len(trajectories) == 2
    for traj in trajectories:
        assert 1 <= len(traj.turns) <= suite.max_turns
        assert 0.0 <= traj.reward <= 1.0 and traj.success == (traj.reward == 1.0)
        assert traj.end_reason in {"done", "max_turns", "context_limit"}


def test_simulators_are_pooled(suite, loop):
    gc.collect()
    task = suite.train_task(0)
    demo = suite.demonstration(task)
    started = suite.pool.started
    for _ in range(2):
        loop.play_actions([EpisodeRequest(task=task)], [demo])
        gc.collect()
    assert suite.pool.started == started  # the JVMs of earlier episodes were reused


def test_missing_java_says_how_to_install_it(monkeypatch):
    from r3lightning.envs import scienceworld_env

    monkeypatch.setattr(scienceworld_env.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="apt-get install default-jre"):
        scienceworld_env.require_java()
    if _importable("scienceworld"):
        with pytest.raises(RuntimeError, match="java"):
            scienceworld_env.ScienceWorldSuite(task_names=[TASK])


def test_missing_package_names_the_extra(monkeypatch):
    from r3lightning.envs.scienceworld_env import ScienceWorldSuite

    monkeypatch.setitem(sys.modules, "scienceworld", None)
    monkeypatch.setitem(sys.modules, "scienceworld.constants", None)
    with pytest.raises(ImportError, match=r"pip install 'r3lightning\[envs\]'"):
        ScienceWorldSuite()


def _importable(name):
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
