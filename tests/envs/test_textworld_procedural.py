import os
import random
import subprocess
import sys
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.envs.base import Environment, Task, TaskSuite
from r3lightning.envs.textworld_procedural import (
    DEFAULT_MAX_TURNS,
    INFO_VERBS,
    KEY,
    ProceduralWorldEnv,
    ProceduralWorldSuite,
    Receptacle,
    State,
    World,
    admissible_actions,
    apply_action,
    diagnose,
    expert_plan,
    goal_reached,
    normalize_command,
    optimal_distance,
    replay,
    shortest_plan,
    world_of,
)

DIFFICULTIES = (1, 2, 3, 4)
SUITES = {d: ProceduralWorldSuite(difficulty=d, num_val_tasks=32) for d in DIFFICULTIES}
REFLECTION_KEYS = {"trajectory_summary", "root_cause_analysis", "trajectory_outcome", "improvement_suggestion",
                   "retry_from_step"}


def run_episode(suite: ProceduralWorldSuite, task: Task, actions: list[str]):
    env = suite.make_env()
    observations = [env.reset(task)]
    results = []
    for action in actions:
        results.append(env.step(action))
        observations.append(results[-1].observation)
        if results[-1].done:
            break
    return observations, results


def bfs_distance(world: World, start: State) -> int:
    """Reference shortest-plan length by breadth-first search over world states.

    Commands that only inform (look, examine, ...) or move a distractor object leave every other part
    of the state, and every other command's outcome, unchanged (carrying is unbounded), so they are
    skipped and states are compared without distractor positions.
    """
    relevant = {world.goal_object, KEY}

    def signature(state: State) -> tuple:
        return state.room, tuple(p for p in state.locations if p[0] in relevant), state.container_status

    frontier = deque([(start, 0)])
    seen = {signature(start)}
    while frontier:
        state, distance = frontier.popleft()
        if goal_reached(world, state):
            return distance
        for action in admissible_actions(world, state):
            words = action.split()
            if words[0] in INFO_VERBS or (words[0] in ("take", "put") and words[1] not in relevant):
                continue
            nxt = apply_action(world, state, action).state
            if signature(nxt) not in seen:
                seen.add(signature(nxt))
                frontier.append((nxt, distance + 1))
    raise AssertionError("goal unreachable")


def random_walk_states(world: World, rng: random.Random, length: int) -> list[State]:
    states = [world.start]
    for _ in range(length):
        states.append(apply_action(world, states[-1], rng.choice(admissible_actions(world, states[-1]))).state)
    return states


# ---------------------------------------------------------------------------------------------------
# Expert and planner


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_expert_solves_every_task_optimally(difficulty):
    suite = SUITES[difficulty]
    for index in range(200):
        task = suite.train_task(index)
        plan = expert_plan(task)
        assert suite.demonstration(task) == plan
        assert 2 * len(plan) <= suite.max_turns == DEFAULT_MAX_TURNS[difficulty]
        assert optimal_distance(task, []) == len(plan)
        _, results = run_episode(suite, task, plan)
        assert len(results) == len(plan), "the episode ended before the plan did"
        assert results[-1].done and results[-1].info["success"] and results[-1].reward == 1.0
        assert not any(r.info["invalid_action"] for r in results)
        assert all(not r.done and r.reward == 0.0 for r in results[:-1])


@pytest.mark.parametrize(("difficulty", "num_tasks"), [(1, 40), (2, 40), (3, 40), (4, 12)])
def test_planner_matches_breadth_first_search(difficulty, num_tasks):
    # From the start and from states a random walk reaches (object or key moved, containers toggled).
    # The search is slow at difficulty 4 (~0.2 s a state), hence fewer tasks there.
    rng = random.Random(difficulty)
    for index in range(num_tasks):
        world = world_of(SUITES[difficulty].train_task(index))
        for state in random_walk_states(world, rng, length=6)[::3]:
            assert len(shortest_plan(world, state)) == bfs_distance(world, state)


@pytest.mark.parametrize(("apple_room", "key_room"), [("hallway", "pantry"), ("pantry", "hallway")])
def test_planner_picks_the_cheaper_fetch_order(apple_room, key_room):
    # Rooms in a chain pantry - kitchen - hallway - study; the agent starts in the kitchen and the
    # destination safe (study) is locked. Fetching first whatever lies away from the study saves two moves.
    world = World(
        rooms=("pantry", "kitchen", "hallway", "study"),
        exits=(("pantry", "kitchen"), ("kitchen", "hallway"), ("hallway", "study")),
        receptacles=(Receptacle("shelf", "pantry", False), Receptacle("table", "hallway", False),
                     Receptacle("safe", "study", True)),
        goal_object="apple",
        goal_receptacle="safe",
        start=State("kitchen", (("apple", "shelf" if apple_room == "pantry" else "table"),
                                ("key", "shelf" if key_room == "pantry" else "table")), (("safe", "locked"),)),
    )
    plan = shortest_plan(world, world.start)
    assert len(plan) == bfs_distance(world, world.start) == 9
    assert plan[0] == "go to pantry"


def test_admissible_actions_are_exactly_the_valid_commands():
    rng = random.Random(0)
    for difficulty in DIFFICULTIES:
        world = world_of(SUITES[difficulty].train_task(1))
        names = list(world.rooms) + [r.name for r in world.receptacles] + world.objects
        grammar = ["look", "inventory"] + [f"{verb} {a}" for verb in ("go to", "take", "open", "close", "examine")
                                           for a in names]
        grammar += [f"take {a} from {b}" for a in names for b in names]
        grammar += [f"put {a} {p} {b}" for a in names for b in names for p in ("in", "on")]
        grammar += [f"unlock {a} with {b}" for a in names for b in names]
        for state in random_walk_states(world, rng, length=8)[::4]:
            valid = {c for c in grammar if not apply_action(world, state, c).invalid}
            listed = admissible_actions(world, state)
            assert listed == sorted(set(listed)) and len(listed) <= 30
            # "take X from Y" is the one accepted alias; it is listed as "take X".
            assert {c.split(" from ")[0] for c in valid} == set(listed)


# ---------------------------------------------------------------------------------------------------
# Suite: determinism, splits, observations


def test_tasks_are_deterministic_in_seed_and_index():
    a, b = ProceduralWorldSuite(difficulty=3, seed=7), ProceduralWorldSuite(difficulty=3, seed=7)
    for index in (0, 5, 123456):
        assert a.train_task(index) == b.train_task(index)
    assert [t.prompt for t in a.val_tasks()] == [t.prompt for t in b.val_tasks()]
    other = ProceduralWorldSuite(difficulty=3, seed=8)
    assert [a.train_task(i).task_id for i in range(20)] != [other.train_task(i).task_id for i in range(20)]
    task = a.train_task(5)
    rebuilt = Task(task_id=task.task_id, prompt="", data=dict(task.data))
    assert a.make_env().reset(rebuilt) == task.prompt


def test_layouts_do_not_depend_on_the_hash_seed():
    script = ("import hashlib; from r3lightning.envs.textworld_procedural import ProceduralWorldSuite as S; "
              "prompts = ''.join(S(difficulty=4).train_task(i).prompt for i in range(20)); "
              "print(hashlib.sha256(prompts.encode()).hexdigest())")
    outputs = {
        subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": salt},
                       capture_output=True, text=True, check=True).stdout
        for salt in ("1", "2")
    }
    assert len(outputs) == 1


@pytest.mark.parametrize("difficulty", (1, 4))
def test_train_and_val_are_disjoint(difficulty):
    suite = ProceduralWorldSuite(difficulty=difficulty, num_val_tasks=64)
    val = suite.val_tasks()
    train = [suite.train_task(i) for i in range(500)]
    assert len({t.task_id for t in val}) == 64
    assert not {t.task_id for t in train} & {t.task_id for t in val}
    assert all(t.data["seed"] % 2 == 0 for t in train) and all(t.data["seed"] % 2 == 1 for t in val)
    assert not {world_of(t) for t in train} & {world_of(t) for t in val}


@pytest.mark.parametrize("difficulty", (1, 2))
def test_observations_are_short(difficulty):
    suite = SUITES[difficulty]
    rng = random.Random(difficulty)
    for index in range(100):
        task = suite.train_task(index)
        world = world_of(task)
        # An expert episode and a random walk (which may carry several objects).
        observations, _ = run_episode(suite, task, expert_plan(task))
        walk = []
        for state in random_walk_states(world, rng, length=suite.max_turns):
            walk.append(rng.choice(admissible_actions(world, state)))
        observations += run_episode(suite, task, walk)[0]
        assert max(len(o.split()) for o in observations) < 120
    assert "Valid actions: " in task.prompt and task.prompt.startswith("Your task: put the ")


def test_suite_speaks_the_protocol():
    suite = ProceduralWorldSuite()
    env = suite.make_env()
    assert isinstance(suite, TaskSuite)
    assert isinstance(env, Environment) and isinstance(env, ProceduralWorldEnv)
    assert "<action>" in suite.system_prompt and suite.max_turns == DEFAULT_MAX_TURNS[1]
    with pytest.raises(ValueError):
        ProceduralWorldSuite(difficulty=5)


# ---------------------------------------------------------------------------------------------------
# Episodes


def test_invalid_action_feedback_and_flag():
    suite = SUITES[2]
    task = suite.train_task(0)
    env = suite.make_env()
    first = env.reset(task)
    result = env.step("dance with the apple")
    assert result.info["feedback"] == "Nothing happens." and result.info["invalid_action"]
    assert not result.done and result.reward == 0.0 and not result.info["success"]
    assert result.observation.split("\n")[1:] == first.split("\n")[1:], "a failed command changed the world"
    result = env.step("take unicorn")
    assert result.info["feedback"] == "You can't see any unicorn here." and result.info["invalid_action"]
    result = env.step("look")
    assert not result.info["invalid_action"]
    assert result.info["admissible_actions"] == admissible_actions(world_of(task), world_of(task).start)


def test_action_tags_are_parsed():
    assert normalize_command("I should grab it. <action>Take  Apple</action>") == "take apple"
    assert normalize_command("<action>go to kitchen.</action> then <action>look</action>") == "go to kitchen"
    assert normalize_command("  open fridge ") == "open fridge"


def test_locked_container_needs_the_key():
    world = World(
        rooms=("kitchen", "study"),
        exits=(("kitchen", "study"),),
        receptacles=(Receptacle("safe", "kitchen", True), Receptacle("table", "kitchen", False),
                     Receptacle("drawer", "study", True)),
        goal_object="apple",
        goal_receptacle="table",
        start=State("kitchen", (("apple", "safe"), ("key", "drawer")),
                    (("drawer", "closed"), ("safe", "locked"))),
    )
    state = world.start
    for command, feedback in [
        ("open safe", "The safe is locked."),
        ("take apple", "You can't see any apple here."),
        ("unlock safe with key", "You don't have the key."),
        ("go to study", "You go to the study."),
        ("take key", "You can't see any key here."),
        ("open drawer", "You open the drawer."),
        ("take key from drawer", "You take the key."),
        ("go to kitchen", "You go to the kitchen."),
        ("unlock safe with key", "You unlock the safe with the key."),
        ("put key in safe", "The safe is closed."),
        ("open safe", "You open the safe."),
        ("take apple", "You take the apple."),
        ("put apple in table", "You can put things on the table, not in it."),
        ("put apple on table", "You put the apple on the table."),
    ]:
        outcome = apply_action(world, state, command)
        assert outcome.feedback == feedback, command
        state = outcome.state
    assert goal_reached(world, state)
    assert list(shortest_plan(world, world.start)) == [
        "go to study", "open drawer", "take key", "go to kitchen", "unlock safe with key", "open safe",
        "take apple", "put apple on table"]


def test_locked_tasks_fail_without_the_key():
    suite = SUITES[4]
    for index in range(20):
        task = suite.train_task(index)
        plan = expert_plan(task)
        assert "take key" in plan and any(a.startswith("unlock ") for a in plan)
        without_key = [a for a in plan if a != "take key"]
        _, results = run_episode(suite, task, without_key)
        unlock = next(r for a, r in zip(without_key, results) if a.startswith("unlock "))
        assert unlock.info["invalid_action"] and unlock.info["feedback"] == "You don't have the key."
        assert not results[-1].info["success"]


def test_step_limit_ends_the_episode():
    suite = ProceduralWorldSuite(difficulty=1, max_turns=3)
    env = suite.make_env()
    env.reset(suite.train_task(0))
    results = [env.step("look") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert not results[-1].info["success"] and results[-1].reward == 0.0
    assert "run out of turns" in results[-1].observation and results[-1].info["admissible_actions"] == []
    with pytest.raises(RuntimeError):
        env.step("look")


# ---------------------------------------------------------------------------------------------------
# Diagnostician


def test_diagnose_optimal_success_and_truncated_failure():
    task = SUITES[3].train_task(3)
    plan = expert_plan(task)
    report = diagnose(task, plan)
    assert set(report) == REFLECTION_KEYS
    assert report["trajectory_outcome"] == "success" and report["retry_from_step"] == 0
    report = diagnose(task, plan[:-1])
    assert report["trajectory_outcome"] == "failure" and report["retry_from_step"] == len(plan) - 1
    assert plan[-1] in report["improvement_suggestion"]


def test_diagnose_explains_a_hidden_object():
    suite = SUITES[2]
    # A one-room task whose object starts in a closed container: the expert opens it first.
    task = next(t for t in map(suite.train_task, range(200))
                if expert_plan(t)[:2] == [expert_plan(t)[0], f"take {world_of(t).goal_object}"]
                and expert_plan(t)[0].startswith("open "))
    plan = expert_plan(task)
    container, obj = plan[0].split()[1], world_of(task).goal_object
    report = diagnose(task, [f"take {obj}"] + plan)
    assert report["retry_from_step"] == 0 and report["trajectory_outcome"] == "success_but_inefficient"
    assert report["root_cause_analysis"] == (
        f"At step 0 you tried 'take {obj}', but the {obj} is in the closed {container}.")
    assert report["improvement_suggestion"].startswith(f"At step 0, do 'open {container}' instead of 'take {obj}'.")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(difficulty=st.sampled_from(DIFFICULTIES), index=st.integers(0, 10**6), data=st.data())
def test_pivot_is_the_injected_mistake(difficulty, index, data):
    suite = SUITES[difficulty]
    task = suite.train_task(index)
    world = world_of(task)
    plan = expert_plan(task)
    j = data.draw(st.integers(0, len(plan) - 1), label="mistake step")
    state = replay(world, plan[:j])
    distance = len(shortest_plan(world, state))
    wrong = [a for a in admissible_actions(world, state)
             if len(shortest_plan(world, apply_action(world, state, a).state)) != distance - 1]
    mistake = data.draw(st.sampled_from(wrong + ["dance", "take unicorn", "go to moon"]), label="mistake")
    actions = plan[:j] + [mistake] + list(shortest_plan(world, apply_action(world, state, mistake).state))
    _, results = run_episode(ProceduralWorldSuite(difficulty, max_turns=len(actions)), task, actions)
    assert results[-1].info["success"] and len(results) == len(actions)

    report = diagnose(task, actions, [r.info["feedback"] for r in results])
    assert set(report) == REFLECTION_KEYS
    assert report["retry_from_step"] == j
    assert report["trajectory_outcome"] == "success_but_inefficient"
    assert f"step {j}" in report["root_cause_analysis"]
    assert f"'{shortest_plan(world, state)[0]}' instead of '{mistake}'" in report["improvement_suggestion"]


def test_goal_reminder_ends_every_observation():
    suite = ProceduralWorldSuite(difficulty=2, goal_reminder=True, num_val_tasks=1)
    task = suite.train_task(3)
    goal = task.prompt.splitlines()[0].removeprefix("Your task: ")
    assert task.prompt.splitlines()[-1] == f"Goal: {goal}"
    env = suite.make_env()
    assert env.reset(task) == task.prompt
    plan = suite.demonstration(task)
    for action in plan[:-1]:
        assert env.step(action).observation.splitlines()[-1] == f"Goal: {goal}"
    assert env.step(plan[-1]).observation.endswith("Task complete.")
    plain = ProceduralWorldSuite(difficulty=2, num_val_tasks=1).train_task(3)
    assert "Goal:" not in plain.prompt and plain.task_id == task.task_id
