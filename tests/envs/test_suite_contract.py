"""The TaskSuite contract (docs/design.md, "Adding an environment"), checked on every suite the
project ships: arithmetic (MathSuite), the procedural world, and the TextWorld, ScienceWorld and
ALFWorld adapters, offline and small (the optional-package suites skip when their package is missing).

A new suite gets these checks by adding one entry to ``SUITES``; the adapter test files keep only
what is particular to their simulator.
"""

import dataclasses
import functools
import os
import subprocess
import sys

import pytest
import torch

from r3lightning.envs.base import StepResult, TaskSuite
from r3lightning.envs.math_env import MathSuite
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.engines.base import SamplingParams

# id: (the factory fixture, the instance fixture, the agent configuration its tasks are played with).
SUITES = {
    "arithmetic": ("make_arithmetic_suite", "arithmetic_suite", AgentLoopConfig(action_format="raw")),
    "procedural-world": ("make_world_suite", "world_suite", None),
    "textworld": ("make_textworld_suite", "textworld_suite", None),
    "scienceworld": ("make_scienceworld_suite", "scienceworld_suite", None),
    "alfworld": ("make_alfworld_suite", "alfworld_suite", None),
}
FIRST_TRAIN = range(8)  # the first training indices the checks look at


@pytest.fixture(scope="module")
def make_arithmetic_suite():
    return functools.partial(MathSuite, source="arithmetic", num_val_tasks=8)


@pytest.fixture(scope="module")
def arithmetic_suite(make_arithmetic_suite):
    return make_arithmetic_suite()


@pytest.fixture(scope="module", params=list(SUITES), ids=list(SUITES))
def case(request):
    make_name, suite_name, agent = SUITES[request.param]
    return request.getfixturevalue(make_name), request.getfixturevalue(suite_name), agent


def test_system_prompt_and_turn_limit(case):
    _, suite, _ = case
    assert isinstance(suite, TaskSuite)
    assert isinstance(suite.system_prompt, str)
    assert isinstance(suite.max_turns, int) and not isinstance(suite.max_turns, bool) and suite.max_turns >= 1


def test_train_task_is_a_pure_function_of_the_index(case):
    """The same task for the same index, again and in a second suite of the same configuration: the
    data cursor is one integer, and a resumed or other-rank run sees the same stream."""
    make, suite, _ = case
    tasks = [suite.train_task(i) for i in FIRST_TRAIN]
    assert [suite.train_task(i) for i in FIRST_TRAIN] == tasks
    again = make()
    try:
        assert [again.train_task(i) for i in FIRST_TRAIN] == tasks
        assert [t.task_id for t in again.val_tasks()] == [t.task_id for t in suite.val_tasks()]
    finally:
        getattr(again, "close", lambda: None)()


def test_val_tasks_are_held_out_from_training(case):
    _, suite, _ = case
    val = suite.val_tasks()
    assert val
    assert {t.task_id for t in val}.isdisjoint(suite.train_task(i).task_id for i in FIRST_TRAIN)


def test_environment_speaks_the_protocol(case):
    """reset gives the observation as a str; every step a StepResult with a reward in [0, 1] and a
    bool ``done``: for a nonsense action, and along the expert's demonstration until it is done."""
    _, suite, _ = case
    task = suite.train_task(0)

    def check(result):
        assert isinstance(result, StepResult)
        assert isinstance(result.observation, str) and isinstance(result.info, dict)
        assert 0.0 <= result.reward <= 1.0
        assert isinstance(result.done, bool)
        return result

    env = suite.make_env()
    assert isinstance(env.reset(task), str)
    check(env.step("xyzzy the frobnicator"))

    env = suite.make_env()
    assert isinstance(env.reset(task), str)
    for action in suite.demonstration(task):
        if check(env.step(action)).done:
            break


def test_demonstrations_succeed_through_the_loop(case, tiny_loops):
    """Every shipped suite has an expert: its demonstrations of training and validation tasks fit the
    turn limit and, played through the agent loop with the suite's tokenizer, solve their tasks."""
    _, suite, agent = case
    loop = tiny_loops(suite, agent)
    tasks = [suite.train_task(i) for i in range(3)] + suite.val_tasks()[:2]
    demos = [suite.demonstration(t) for t in tasks]
    assert all(demos) and all(len(d) <= suite.max_turns for d in demos)
    played = loop.play_actions([EpisodeRequest(task=t, origin="demo") for t in tasks], demos)
    for traj, demo in zip(played, demos):
        assert traj.success and traj.reward == 1.0
        assert traj.actions == demo
        assert traj.end_reason == "done"


def test_random_policy_plays_episodes_through_the_loop(case, tiny_loops):
    _, suite, agent = case
    base = tiny_loops(suite, agent)
    loop = AgentLoop(suite, base.engine, base.tokenizer, dataclasses.replace(base.config, max_context_tokens=1024))
    torch.manual_seed(0)
    tasks = [suite.train_task(i) for i in range(2)]
    trajectories = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(2)], SamplingParams(max_new_tokens=8))
    ends = {"done", "max_turns", "context_limit"}
    if loop.config.action_format == "raw":
        ends.add("length")  # a raw answer cut at the token budget is still an answer, scored and final
    assert len(trajectories) == 4
    for traj in trajectories:
        assert 1 <= len(traj.turns) <= suite.max_turns
        assert 0.0 <= traj.reward <= 1.0 and traj.success == (traj.reward == 1.0)
        assert traj.end_reason in ends


# ---- the optional-package adapters ----------------------------------------------------------------
@pytest.mark.parametrize(
    "module, suite_class, packages, kwargs",
    [
        ("textworld_env", "TextWorldSuite", ["textworld"], {}),
        ("scienceworld_env", "ScienceWorldSuite", ["scienceworld", "scienceworld.constants"], {}),
        ("alfworld_env", "ALFWorldSuite", ["alfworld"], {"data_dir": "/nonexistent"}),
    ],
    ids=["textworld", "scienceworld", "alfworld"],
)
def test_missing_package_names_the_extra(monkeypatch, module, suite_class, packages, kwargs):
    import importlib

    cls = getattr(importlib.import_module(f"r3lightning.envs.{module}"), suite_class)
    for package in packages:
        monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail as if not installed
    with pytest.raises(ImportError, match=r"pip install 'r3lightning\[envs\]'"):
        cls(**kwargs)


def test_environment_modules_import_their_packages_lazily():
    code = (
        "import sys\n"
        "import r3lightning.envs\n"
        "import r3lightning.envs.textworld_env, r3lightning.envs.scienceworld_env, r3lightning.envs.alfworld_env\n"
        "loaded = {'textworld', 'scienceworld', 'alfworld', 'fast_downward', 'jericho', 'py4j'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
