"""ALFWorld suite on tiny hand-written PDDL games (tests/alfworld_games.py, no downloaded data):
discovery and splits, observations and feedback, the step limit, planned and stored demonstrations,
game pooling, random admissible actions, missing data.

What every suite must do (pure task streams, held-out validation, the environment protocol, expert
demonstrations and a random policy through the agent loop) is checked in test_suite_contract.py on
the ``alfworld_suite`` fixture (tests/conftest.py).
"""

import gc

import pytest
import torch
from alfworld_games import STORED_WALKTHROUGH

from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.engines.base import SamplingParams


def test_discovery_filters_and_splits(alfworld_suite):
    suite = alfworld_suite
    train = {suite.train_task(i).task_id for i in range(6)}
    assert train == {
        "alfworld:train/pick_and_place_simple-Apple-None-Fridge-1/trial_T0",
        "alfworld:train/pick_and_place_simple-Mug-None-Cabinet-1/trial_T0",
    }
    assert [t.task_id for t in suite.val_tasks()] == ["alfworld:valid_unseen/pick_and_place_simple-Mug-None-Fridge-3/trial_T0"]
    assert suite.max_turns == 25
    assert suite.train_task(0).data["task_type"] == "pick_and_place_simple"
    # Each pass over the two games is a permutation of them.
    assert {suite.train_task(0).task_id, suite.train_task(1).task_id} == train


def test_observations_and_feedback(alfworld_suite):
    suite = alfworld_suite
    task = next(t for t in (suite.train_task(i) for i in range(2)) if "Apple" in t.task_id)
    env = suite.make_env()
    first = env.reset(task)
    assert "Welcome to TextWorld" not in first
    assert "Your task is to: put an apple in fridge." in first
    assert first.splitlines()[-1] == "Valid actions: go to cabinet 1, go to countertop 1, go to fridge 1, inventory, look."

    bad = env.step("fly to the moon")
    assert bad.info["invalid_action"] and bad.feedback == "Nothing happens." and not bad.done and bad.reward == 0.0
    arrive = env.step("<action>Go to countertop 1.</action>")  # tag, case and trailing period are normalized
    assert arrive.feedback == "You arrive at countertop 1. On the countertop 1, you see a apple 1, and a mug 1."
    assert "take apple 1 from countertop 1" in arrive.info["admissible_actions"]
    assert "help" not in arrive.info["admissible_actions"]
    for action in ["take apple 1 from countertop 1", "go to fridge 1", "open fridge 1"]:
        result = env.step(action)
        assert not result.done and not result.info["invalid_action"]
    final = env.step("move apple 1 to fridge 1")
    assert final.done and final.info["success"] and final.reward == 1.0
    assert final.observation == "You move the apple 1 to the fridge 1.\nTask complete."
    assert final.info["admissible_actions"] == []


def test_step_limit(alfworld_data):
    from r3lightning.envs.alfworld_env import ALFWorldSuite

    short = ALFWorldSuite(data_dir=str(alfworld_data), max_turns=2, list_admissible=False)
    env = short.make_env()
    first = env.reset(short.train_task(0))
    assert "Valid actions" not in first
    assert not env.step("look").done
    last = env.step("inventory")
    assert last.done and not last.info["success"] and last.reward == 0.0
    assert last.observation.endswith("You have run out of turns.")


def test_demonstrations_planned_or_stored(alfworld_suite):
    suite = alfworld_suite
    tasks = {t.task_id: t for t in (suite.train_task(i) for i in range(2))}
    planned = suite.demonstration(tasks["alfworld:train/pick_and_place_simple-Apple-None-Fridge-1/trial_T0"])
    assert planned == ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1", "open fridge 1",
                       "move apple 1 to fridge 1"]
    assert suite.demonstration(tasks["alfworld:train/pick_and_place_simple-Mug-None-Cabinet-1/trial_T0"]) == STORED_WALKTHROUGH


def test_random_policy_gets_binary_rewards_and_games_are_reused(alfworld_suite, tiny_loops):
    suite, base = alfworld_suite, tiny_loops(alfworld_suite)
    torch.manual_seed(0)
    tasks = [suite.train_task(i) for i in range(2)]
    small = AgentLoop(suite, base.engine, base.tokenizer, AgentLoopConfig(max_context_tokens=640))
    trajectories = small.run([EpisodeRequest(task=t) for t in tasks for _ in range(2)], SamplingParams(max_new_tokens=8))
    assert all(traj.reward in (0.0, 1.0) for traj in trajectories)
    gc.collect()
    assert suite.pool.started <= 4 + 2  # one game per concurrent episode, reused afterwards


def test_random_valid_actions_episodes(alfworld_suite, tiny_loops):
    """Uniformly random admissible actions: exercises many transitions; rewards stay 0/1."""
    import random

    suite, loop = alfworld_suite, tiny_loops(alfworld_suite)
    rng = random.Random(0)
    task = suite.train_task(0)
    env = suite.make_env()
    env.reset(task)
    actions, result = [], None
    for _ in range(suite.max_turns):
        options = (result.info["admissible_actions"] if result else None) or ["look"]
        actions.append(rng.choice(options))
        result = env.step(actions[-1])
        assert result.reward in (0.0, 1.0) and not result.info["invalid_action"]
        if result.done:
            break
    replayed = loop.play_actions([EpisodeRequest(task=task)], [actions])[0]
    assert replayed.reward == result.reward and len(replayed.turns) == len(actions)


def test_missing_data_names_the_download_command(tmp_path, monkeypatch):
    pytest.importorskip("alfworld")
    pytest.importorskip("fast_downward")
    from r3lightning.envs.alfworld_env import ALFWorldSuite

    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="alfworld-download") as missing:
        ALFWorldSuite()
    assert "ALFWORLD_DATA" in str(missing.value) and "nowhere" in str(missing.value)
    (tmp_path / "empty" / "json_2.1.1" / "train").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no playable game.tw-pddl"):
        ALFWorldSuite(data_dir=str(tmp_path / "empty"))


def test_unknown_task_type_is_rejected(make_alfworld_suite):
    with pytest.raises(ValueError, match="unknown ALFWorld task types"):
        make_alfworld_suite(task_types=["pick_and_juggle"])
