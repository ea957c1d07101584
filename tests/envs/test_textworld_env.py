"""TextWorld suite: generated and pre-made games, observations, rewards, splits, agent-loop play."""

import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from r3lightning.data.datamodule import corpus_from_suite
from r3lightning.models import TinyModelSpec, build_tiny_model, build_tokenizer
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.rollout.engine import SamplingParams
from r3lightning.rollout.hf_engine import HFEngine

SPEC = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=400)
SETTINGS = dict(world_size=2, nb_objects=3, quest_length=2)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    pytest.importorskip("textworld")
    from r3lightning.envs.textworld_env import TextWorldSuite

    return TextWorldSuite(cache_dir=str(tmp_path_factory.mktemp("tw-cache")), num_train_games=2, num_val_tasks=1,
                          max_turns=6, **SETTINGS)


@pytest.fixture(scope="module")
def tokenizer(suite):
    # Plays every demonstration once, which also generates the three games into the cache.
    return build_tokenizer(corpus_from_suite(suite, AgentLoopConfig(), num_tasks=2), vocab_size=SPEC.vocab_size)


@pytest.fixture(scope="module")
def loop(suite, tokenizer):
    model = build_tiny_model(SPEC, tokenizer, seed=0)
    return AgentLoop(suite, HFEngine(model, tokenizer), tokenizer, AgentLoopConfig(max_context_tokens=8192))


def test_random_model_plays_episodes_through_the_loop(suite, tokenizer, loop):
    torch.manual_seed(0)
    tasks = [suite.train_task(i) for i in range(2)]
    small = AgentLoop(suite, loop.engine, tokenizer, AgentLoopConfig(max_context_tokens=1024))
    trajectories = small.run([EpisodeRequest(task=t) for t in tasks for _ in range(2)], SamplingParams(max_new_tokens=8))
    assert len(trajectories) == 4
    for traj in trajectories:
        assert 1 <= len(traj.turns) <= suite.max_turns
        assert 0.0 <= traj.reward <= 1.0
        assert traj.end_reason in {"done", "max_turns", "context_limit"}
        assert traj.success == (traj.reward == 1.0)
        assert "Valid actions:" in tokenizer.decode(traj.turns[0].context_ids)


def test_walkthrough_demonstrations_succeed_through_the_loop(suite, loop):
    tasks = [suite.train_task(i) for i in range(2)] + suite.val_tasks()
    demos = [suite.demonstration(t) for t in tasks]
    assert all(demos), "generated games store their walkthrough"
    played = loop.play_actions([EpisodeRequest(task=t, origin="demo") for t in tasks], demos)
    for traj, demo in zip(played, demos):
        assert traj.success and traj.reward == 1.0
        assert traj.actions == demo
        assert traj.end_reason == "done"


def test_observations_rewards_and_info(suite):
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


def test_step_limit_and_unlisted_actions(suite):
    from r3lightning.envs.textworld_env import TextWorldSuite

    quiet = TextWorldSuite(cache_dir=str(suite.cache_dir), num_train_games=2, num_val_tasks=1, max_turns=2,
                           list_admissible=False, **SETTINGS)
    env = quiet.make_env()
    first = env.reset(quiet.train_task(0))
    assert "Valid actions" not in first
    assert not env.step("look").done
    last = env.step("look")
    assert last.done and not last.info["success"] and last.reward == 0.0
    assert last.observation.endswith("You have run out of turns.")


def test_splits_are_disjoint_by_seed_and_deterministic(suite):
    from r3lightning.envs.textworld_env import TextWorldSuite

    train = [suite.train_task(i) for i in range(6)]
    val = suite.val_tasks()
    assert all(t.data["seed"] % 2 == 0 for t in train) and all(t.data["seed"] % 2 == 1 for t in val)
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in val})
    assert len({t.task_id for t in train}) == 2  # num_train_games=2: the stream cycles over two games
    again = TextWorldSuite(cache_dir=str(suite.cache_dir), num_train_games=2, num_val_tasks=1, max_turns=6, **SETTINGS)
    assert [again.train_task(i) for i in range(6)] == train
    assert [t.task_id for t in again.val_tasks()] == [t.task_id for t in val]


def test_started_games_are_reused_across_episodes(suite, loop):
    task = suite.train_task(0)
    demo = suite.demonstration(task)
    loop.play_actions([EpisodeRequest(task=task)], [demo])
    gc.collect()
    started = suite.pool.started
    for _ in range(3):
        loop.play_actions([EpisodeRequest(task=task)], [demo])
    gc.collect()
    assert suite.pool.started == started


def test_games_dir_made_offline_with_tw_make(suite, tmp_path):
    from r3lightning.envs.textworld_env import TextWorldSuite

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


def test_missing_package_names_the_extra(monkeypatch):
    from r3lightning.envs.textworld_env import TextWorldSuite

    monkeypatch.setitem(sys.modules, "textworld", None)
    with pytest.raises(ImportError, match=r"pip install 'r3lightning\[envs\]'"):
        TextWorldSuite()


def test_environment_modules_import_their_packages_lazily():
    code = (
        "import sys\n"
        "import r3lightning.envs\n"
        "import r3lightning.envs.textworld_env, r3lightning.envs.scienceworld_env, r3lightning.envs.alfworld_env\n"
        "loaded = {'textworld', 'scienceworld', 'alfworld', 'fast_downward', 'jericho', 'py4j'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
