"""ALFWorld suite on tiny hand-written PDDL games (no downloaded data), through the agent loop.

Each game is a ``game.tw-pddl`` JSON file as ``alfworld-download`` ships them: ALFWorld's PDDL domain
and text grammar (both inside the ``alfworld`` package) with the goal sentence filled in, a PDDL
problem written below, and ``solvable: true``.
"""

import gc
import json
import sys

import pytest
import torch

from r3lightning.data.datamodule import corpus_from_suite
from r3lightning.models import TinyModelSpec, build_tiny_model, build_tokenizer
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.rollout.engine import SamplingParams
from r3lightning.rollout.hf_engine import HFEngine

SPEC = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=400)

# ALFRED object ids as in the real data: "Apple|-01.00|+00.90|+01.00" mangled to PDDL-safe names; the
# suite's demangler shows them as "apple 1".
APPLE = "Apple_bar__minus_01_dot_00_bar__plus_00_dot_90_bar__plus_01_dot_00"
MUG = "Mug_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_01_dot_00"
COUNTER = "CounterTop_bar__minus_01_dot_00_bar__plus_00_dot_95_bar__plus_01_dot_00"
FRIDGE = "Fridge_bar__plus_01_dot_00_bar__plus_00_dot_00_bar__plus_01_dot_00"
CABINET = "Cabinet_bar__plus_02_dot_00_bar__plus_01_dot_00_bar__plus_01_dot_00"


def problem(target_type: str, destination_type: str) -> str:
    """A kitchen with a countertop (apple and mug on it), a closed fridge and a closed cabinet; the goal
    is "put a <target_type> in/on a <destination_type>" (ALFWorld's pick_and_place_simple)."""
    return f"""(define (problem plan_tiny)
(:domain alfred)
(:objects
    agent1 - agent
    AppleType MugType - otype
    CounterTopType FridgeType CabinetType - rtype
    {APPLE} {MUG} - object
    {COUNTER} {FRIDGE} {CABINET} - receptacle
    loc_bar_start loc_bar_counter loc_bar_fridge loc_bar_cabinet - location
)
(:init
    (atLocation agent1 loc_bar_start)
    (receptacleType {COUNTER} CounterTopType)
    (receptacleType {FRIDGE} FridgeType)
    (receptacleType {CABINET} CabinetType)
    (receptacleAtLocation {COUNTER} loc_bar_counter)
    (receptacleAtLocation {FRIDGE} loc_bar_fridge)
    (receptacleAtLocation {CABINET} loc_bar_cabinet)
    (openable {FRIDGE})
    (openable {CABINET})
    (objectType {APPLE} AppleType)
    (objectType {MUG} MugType)
    (pickupable {APPLE})
    (pickupable {MUG})
    (inReceptacle {APPLE} {COUNTER})
    (inReceptacle {MUG} {COUNTER})
    (objectAtLocation {APPLE} loc_bar_counter)
    (objectAtLocation {MUG} loc_bar_counter)
    (canContain FridgeType AppleType)
    (canContain FridgeType MugType)
    (canContain CabinetType MugType)
    (canContain CounterTopType AppleType)
    (canContain CounterTopType MugType)
)
(:goal
    (exists (?r - receptacle)
        (exists (?o - object)
            (and
                (inReceptacle ?o ?r)
                (objectType ?o {target_type})
                (receptacleType ?r {destination_type})
            )
        )
    )
)
)
"""


def write_game(root, split, folder, goal, target, destination, solvable=True, walkthrough=None):
    """Write ``<root>/json_2.1.1/<split>/<folder>/trial_T0/game.tw-pddl``."""
    import alfworld.info

    grammar = open(alfworld.info.ALFRED_TWL2_PATH).read().replace("UNKNOWN GOAL", goal)
    data = {
        "pddl_domain": open(alfworld.info.ALFRED_PDDL_PATH).read(),
        "grammar": grammar,
        "pddl_problem": problem(f"{target}Type", f"{destination}Type"),
        "solvable": solvable,
    }
    if walkthrough is not None:
        data["walkthrough"] = walkthrough
    path = root / "json_2.1.1" / split / folder / "trial_T0" / "game.tw-pddl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    return path


STORED_WALKTHROUGH = ["go to countertop 1", "take mug 1 from countertop 1", "go to cabinet 1", "open cabinet 1",
                      "move mug 1 to cabinet 1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    pytest.importorskip("alfworld")
    pytest.importorskip("fast_downward")
    root = tmp_path_factory.mktemp("alfworld-data")
    write_game(root, "train", "pick_and_place_simple-Apple-None-Fridge-1", "put an apple in fridge", "Apple", "Fridge")
    write_game(root, "train", "pick_and_place_simple-Mug-None-Cabinet-1", "put a mug in cabinet", "Mug", "Cabinet",
               walkthrough=STORED_WALKTHROUGH)
    # Skipped like ALFWorld's loader does: not solvable, movable receptacle, other task type.
    write_game(root, "train", "pick_and_place_simple-Mug-None-Fridge-2", "put a mug in fridge", "Mug", "Fridge", solvable=False)
    write_game(root, "train", "pick_and_place_with_movable_recep-Mug-Bowl-Fridge-1", "put a mug in fridge", "Mug", "Fridge")
    write_game(root, "train", "pick_heat_then_place_in_recep-Apple-None-Fridge-1", "put an apple in fridge", "Apple", "Fridge")
    write_game(root, "valid_unseen", "pick_and_place_simple-Mug-None-Fridge-3", "put a mug in fridge", "Mug", "Fridge")
    return root


@pytest.fixture(scope="module")
def suite(data_dir):
    from r3lightning.envs.alfworld_env import ALFWorldSuite

    return ALFWorldSuite(data_dir=str(data_dir), task_types=["pick_and_place_simple"])


@pytest.fixture(scope="module")
def tokenizer(suite):
    return build_tokenizer(corpus_from_suite(suite, AgentLoopConfig(), num_tasks=2), vocab_size=SPEC.vocab_size)


@pytest.fixture(scope="module")
def loop(suite, tokenizer):
    model = build_tiny_model(SPEC, tokenizer, seed=0)
    return AgentLoop(suite, HFEngine(model, tokenizer), tokenizer, AgentLoopConfig(max_context_tokens=8192))


def test_discovery_filters_and_splits(suite):
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


def test_observations_and_feedback(suite):
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


def test_step_limit(data_dir):
    from r3lightning.envs.alfworld_env import ALFWorldSuite

    short = ALFWorldSuite(data_dir=str(data_dir), max_turns=2, list_admissible=False)
    env = short.make_env()
    first = env.reset(short.train_task(0))
    assert "Valid actions" not in first
    assert not env.step("look").done
    last = env.step("inventory")
    assert last.done and not last.info["success"] and last.reward == 0.0
    assert last.observation.endswith("You have run out of turns.")


def test_demonstrations_planned_or_stored(suite):
    tasks = {t.task_id: t for t in (suite.train_task(i) for i in range(2))}
    planned = suite.demonstration(tasks["alfworld:train/pick_and_place_simple-Apple-None-Fridge-1/trial_T0"])
    assert planned == ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1", "open fridge 1",
                       "move apple 1 to fridge 1"]
    assert suite.demonstration(tasks["alfworld:train/pick_and_place_simple-Mug-None-Cabinet-1/trial_T0"]) == STORED_WALKTHROUGH


def test_expert_succeeds_through_the_loop(suite, loop):
    tasks = [suite.train_task(i) for i in range(2)] + suite.val_tasks()
    demos = [suite.demonstration(t) for t in tasks]
    played = loop.play_actions([EpisodeRequest(task=t, origin="demo") for t in tasks], demos)
    for traj, demo in zip(played, demos):
        assert traj.success and traj.reward == 1.0 and traj.actions == demo
        assert traj.end_reason == "done"


def test_random_model_plays_episodes_through_the_loop(suite, tokenizer, loop):
    torch.manual_seed(0)
    tasks = [suite.train_task(i) for i in range(2)]
    small = AgentLoop(suite, loop.engine, tokenizer, AgentLoopConfig(max_context_tokens=640))
    trajectories = small.run([EpisodeRequest(task=t) for t in tasks for _ in range(2)], SamplingParams(max_new_tokens=8))
    assert len(trajectories) == 4
    for traj in trajectories:
        assert 1 <= len(traj.turns) <= suite.max_turns
        assert traj.reward in (0.0, 1.0) and traj.success == (traj.reward == 1.0)
        assert traj.end_reason in {"done", "max_turns", "context_limit"}
    gc.collect()
    assert suite.pool.started <= 4 + 2  # one game per concurrent episode, reused afterwards


def test_random_valid_actions_episodes(suite, loop):
    """Uniformly random admissible actions: exercises many transitions; rewards stay 0/1."""
    import random

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


def test_unknown_task_type_is_rejected(data_dir):
    from r3lightning.envs.alfworld_env import ALFWorldSuite

    with pytest.raises(ValueError, match="unknown ALFWorld task types"):
        ALFWorldSuite(data_dir=str(data_dir), task_types=["pick_and_juggle"])


def test_missing_package_names_the_extra(monkeypatch):
    from r3lightning.envs.alfworld_env import ALFWorldSuite

    monkeypatch.setitem(sys.modules, "alfworld", None)
    with pytest.raises(ImportError, match=r"pip install 'r3lightning\[envs\]'"):
        ALFWorldSuite(data_dir="/nonexistent")
