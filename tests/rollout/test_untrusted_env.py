"""Rewards and environments are untrusted input: bad rewards are masked or clipped and counted,
``reset`` gets the deadline and error handling of ``step``, malformed results are refused by name."""

import math
import threading
import time

import pytest
from scripted_engine import ScriptedEngine

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.engines.base import SamplingParams
from r3lightning.rollout.metrics import trajectory_metrics
from r3lightning.types import Group


def suite_returning(step_result=None, reset=None):
    class Env:
        def reset(self, task):
            return reset(task) if reset else "question"

        def step(self, action):
            return step_result

    class Suite(TaskSuite):
        system_prompt, max_turns = "Answer.", 1

        def make_env(self):
            return Env()

        def train_task(self, index):
            return Task(f"t{index}", "question")

        def val_tasks(self):
            return [Task("v0", "question")]

        def demonstration(self, task):
            return ["x"]

    return Suite()


def play(suite, tokenizer, **config):
    loop = AgentLoop(suite, ScriptedEngine(tokenizer, lambda _: "4"), tokenizer, AgentLoopConfig(action_format="raw", step_timeout_s=0.3, **config))
    return loop.run([EpisodeRequest(task=Task("t0", "question"))], SamplingParams(max_new_tokens=4))[0]


@pytest.mark.parametrize("reward", [math.nan, math.inf, None, "n/a", [1.0]], ids=["nan", "inf", "none", "text", "list"])
def test_a_reward_that_is_not_a_finite_number_is_masked_and_counted(world_tokenizer, reward):
    with pytest.warns(UserWarning, match="not a finite number"):
        import r3lightning.rollout.agent_loop as agent_loop

        agent_loop._WARNED.clear()
        traj = play(suite_returning(StepResult("done", reward, True, {})), world_tokenizer)
    assert traj.reward_error and traj.reward_invalid and traj.reward == 0.0 and not traj.success
    assert trajectory_metrics([Group("t0", [traj])])["reward/invalid_count"] == 1.0


def test_a_reward_outside_the_range_is_clipped_or_masked_and_counted(world_tokenizer):
    suite = suite_returning(StepResult("done", 1000.0, True, {}))
    clipped = play(suite, world_tokenizer)
    assert clipped.reward == 1.0 and clipped.reward_clipped and not clipped.reward_error
    assert trajectory_metrics([Group("t0", [clipped])])["reward/clipped_count"] == 1.0
    masked = play(suite, world_tokenizer, reward_out_of_range="mask")
    assert masked.reward == 0.0 and masked.reward_error and masked.reward_invalid
    with pytest.raises(ValueError, match="reward_out_of_range"):
        AgentLoopConfig(reward_out_of_range="ignore")


def test_reset_raising_or_hanging_ends_that_episode_as_an_environment_error(world_tokenizer):
    def boom(task):
        raise RuntimeError("simulator crashed")

    traj = play(suite_returning(StepResult("", 1.0, True, {}), reset=boom), world_tokenizer)
    assert traj.end_reason == "env_error" and traj.reward_error and traj.turns == [] and "simulator crashed" in traj.env_error

    def hang(task):
        time.sleep(5)
        return "question"

    traj = play(suite_returning(StepResult("", 1.0, True, {}), reset=hang), world_tokenizer)
    assert traj.end_reason == "env_error" and "Timeout" in traj.env_error


def test_a_batch_of_episodes_resets_in_one_hand_off_to_the_env_thread(world_tokenizer):
    # One hand-off per episode was a cost no batch size shrinks: the resets go together, as a turn's steps do.
    seen = []

    def reset(task):
        seen.append(threading.current_thread().name)
        return "question"

    loop = AgentLoop(suite_returning(StepResult("", 1.0, True, {}), reset=reset), ScriptedEngine(world_tokenizer, lambda _: "4"),
                     world_tokenizer, AgentLoopConfig(action_format="raw", step_timeout_s=5.0))
    hand_offs = []
    call_each = loop._call.call_each
    loop._call.call_each = lambda calls, timeout_s: hand_offs.append(len(calls)) or call_each(calls, timeout_s)
    trajectories = loop.run([EpisodeRequest(task=Task(f"t{i}", "question")) for i in range(5)], SamplingParams(max_new_tokens=4))
    assert hand_offs == [5, 5]  # the five resets, then the five steps of the only turn
    assert seen == ["r3l-env-call"] * 5 and all(t.reward == 1.0 for t in trajectories)


@pytest.mark.parametrize(
    "result, field",
    [
        (("obs", 1.0, True, {}), "returned tuple"),
        (StepResult(None, 1.0, True, {}), "StepResult.observation is NoneType"),
        (StepResult("obs", 1.0, True, None), "StepResult.info is NoneType"),
        (StepResult("obs", 1.0, "yes", {}), "StepResult.done is str"),
    ],
    ids=["gym-tuple", "observation-none", "info-none", "done-str"],
)
def test_malformed_step_results_are_refused_naming_environment_and_field(world_tokenizer, result, field):
    with pytest.raises(ValueError, match=field) as error:
        play(suite_returning(result), world_tokenizer)
    assert "Env.step (task 't0')" in str(error.value)


def test_reset_returning_something_else_than_text_is_refused(world_tokenizer):
    with pytest.raises(ValueError, match=r"Suite: Env.reset \(task 't0'\) returned tuple \(a gym-style"):
        play(suite_returning(StepResult("", 1.0, True, {}), reset=lambda task: ("question", {})), world_tokenizer)
