"""TextWorld suite: generated and pre-made games, observations, rewards, splits, game reuse.

What every suite must do (pure task streams, held-out validation, the environment protocol,
demonstrations and a random policy through the agent loop) is checked in test_suite_contract.py on
the ``textworld_suite`` fixture (tests/conftest.py).
"""

import gc
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from r3lightning.rollout.agent_loop import EpisodeRequest


def test_observations_rewards_and_info(textworld_suite):
    suite = textworld_suite
    task = suite.train_task(0)
    demo = suite.demonstration(task)
    env = suite.make_env()
    first = env.reset(task)
    assert "$$" not in first and "\n>" not in first and not first.startswith(">")
    assert first.splitlines()[-1].startswith("Valid actions: ")
    assert demo[0] in first.splitlines()[-1]

    bad = env.step("dance wildly")
    assert bad.info["invalid_action"] and not bad.done and bad.reward == 0.0
    assert bad.info["admissible_actions"] == sorted(bad.info["admissible_actions"])
    assert bad.observation.endswith(f"Valid actions: {', '.join(bad.info['admissible_actions'])}.")

    for i, action in enumerate(demo):
        result = env.step(f"<action>{action.upper()}</action>")  # tags and case are normalized
        assert not result.info["invalid_action"]
        if i < len(demo) - 1:
            assert not result.done and 0.0 <= result.reward < 1.0
    assert result.done and result.info["success"] and result.reward == 1.0
    assert result.info["score"] == result.info["max_score"]
    assert result.observation.endswith("Task complete.") and "RESTART" not in result.observation
    assert result.info["admissible_actions"] == []
    with pytest.raises(RuntimeError):
        env.step("look")


def test_step_limit_and_unlisted_actions(make_textworld_suite):
    quiet = make_textworld_suite(max_turns=2, list_admissible=False)
    env = quiet.make_env()
    first = env.reset(quiet.train_task(0))
    assert "Valid actions" not in first
    assert not env.step("look").done
    last = env.step("look")
    assert last.done and not last.info["success"] and last.reward == 0.0
    assert last.observation.endswith("You have run out of turns.")


def test_splits_are_disjoint_by_seed(textworld_suite):
    train = [textworld_suite.train_task(i) for i in range(6)]
    val = textworld_suite.val_tasks()
    assert all(t.data["seed"] % 2 == 0 for t in train) and all(t.data["seed"] % 2 == 1 for t in val)
    assert len({t.task_id for t in train}) == 2  # num_train_games=2: the stream cycles over two games


def test_started_games_are_reused_across_episodes(textworld_suite, tiny_loops):
    suite, loop = textworld_suite, tiny_loops(textworld_suite)
    task = suite.train_task(0)
    demo = suite.demonstration(task)
    loop.play_actions([EpisodeRequest(task=task)], [demo])
    gc.collect()
    started = suite.pool.started
    for _ in range(3):
        loop.play_actions([EpisodeRequest(task=task)], [demo])
    gc.collect()
    assert suite.pool.started == started


def test_games_dir_made_offline_with_tw_make(textworld_suite, tmp_path):
    from r3lightning.envs.textworld_env import TextWorldSuite

    suite = textworld_suite
    games = tmp_path / "games"
    tw_make = Path(sys.executable).with_name("tw-make")
    command = [str(tw_make)] if tw_make.exists() else [sys.executable, "-m", "textworld.cli.tw_make"]
    subprocess.run(command + ["custom", "--world-size", "2", "--nb-objects", "3", "--quest-length", "2", "--seed", "5",
                              "--output", str(games / "made.z8"), "-f", "--silent"], check=True, timeout=120)
    for task in [suite.train_task(0), suite.train_task(1)]:  # two more, copied from the generator's cache
        src = Path(suite.game_file(task))
        shutil.copy(src, games / src.name)
        shutil.copy(src.with_suffix(".json"), games / src.with_suffix(".json").name)

    made = TextWorldSuite(games_dir=str(games), num_val_tasks=1, max_turns=10)
    val = made.val_tasks()
    train = {made.train_task(i).task_id for i in range(4)}
    assert len(val) == 1 and len(train) == 2 and val[0].task_id not in train
    assert made.game_file(val[0]).endswith(".z8")
    tasks = val + [made.train_task(i) for i in range(2)]
    env = made.make_env()
    for task in tasks:
        env.reset(task)
        demo = made.demonstration(task)
        assert demo, f"{task.task_id} has a walkthrough"
        for action in demo:
            result = env.step(action)
        assert result.done and result.info["success"] and result.reward == 1.0


def test_empty_or_missing_games_dir_is_explained(tmp_path):
    pytest.importorskip("textworld")
    from r3lightning.envs.textworld_env import TextWorldSuite

    with pytest.raises(FileNotFoundError, match="tw-make"):
        TextWorldSuite(games_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        TextWorldSuite(games_dir=str(tmp_path / "nope"))
