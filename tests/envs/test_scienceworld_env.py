"""ScienceWorld suite (JVM simulator): splits, the first observation, rewards, failures, the step
limit and valid-action listing, simulator pooling, missing Java.

What every suite must do (pure task streams, held-out validation, the environment protocol, gold
demonstrations and a random policy through the agent loop) is checked in test_suite_contract.py on
the ``scienceworld_suite`` fixture (tests/conftest.py): one task, ``find-living-thing``, keeps the
session to a few JVM starts.
"""

import gc

import pytest
from harness import SCIENCEWORLD_TASK as TASK

from r3lightning.rollout.agent_loop import EpisodeRequest


def test_splits_follow_the_package_variations(scienceworld_suite):
    suite = scienceworld_suite
    variations = suite.variations[TASK]
    assert variations["train"] and variations["dev"] and variations["test"]
    assert set(variations["train"]).isdisjoint(variations["dev"])
    train = [suite.train_task(i) for i in range(5)]
    assert all(t.data["variation"] in variations["train"] and t.data["task_name"] == TASK for t in train)
    val = suite.val_tasks()
    assert [t.data["variation"] for t in val] == variations["dev"][:1]
    assert suite.max_turns == 30
    assert len({t.task_id for t in train}) == 5  # one shuffled pass over 150 training variations


def test_first_observation_states_the_task_and_the_room(scienceworld_suite):
    first = scienceworld_suite.make_env().reset(scienceworld_suite.train_task(0))
    assert "Your task is to find a(n) living thing" in first and "This room is called" in first


def test_reward_is_clipped_score_and_failure_ends_the_episode(scienceworld_suite):
    suite = scienceworld_suite
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


def test_step_limit_and_valid_action_listing(scienceworld_suite, make_scienceworld_suite):
    listing = make_scienceworld_suite(max_turns=2, list_valid_actions=True)
    try:
        env = listing.make_env()
        first = env.reset(scienceworld_suite.train_task(0))
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


def test_simulators_are_pooled(scienceworld_suite, tiny_loops):
    suite, loop = scienceworld_suite, tiny_loops(scienceworld_suite)
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


def _importable(name):
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
