"""Replaying a retry's prefix: a failed replay costs that retry, not the step; malformed prefix turns
replay as they happened (R³L fidelity, items 6 and 7)."""

import json
import time

from scripted_engine import ScriptedEngine

from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest, render_action
from r3lightning.engines.base import SamplingParams
from r3lightning.rollout.explorers.base import ExplorationSpec
from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer


class FlakyVerifierSuite(TaskSuite):
    """Three attempts at a question; the verifier hangs while ``hang`` is set (a timeout on re-checking)."""

    system_prompt = "Answer."
    max_turns = 3
    hang = False

    class Env:
        def reset(self, task):
            return "What is 1+1?"

        def step(self, action):
            if FlakyVerifierSuite.hang:
                time.sleep(5)
            right = action.strip() == "2"
            return StepResult("Correct." if right else "Incorrect, try again.", float(right), right, {"success": right})

    def make_env(self):
        return self.Env()

    def train_task(self, index):
        return Task(f"t{index}", "What is 1+1?")

    def val_tasks(self):
        return [Task("v0", "What is 1+1?")]

    def demonstration(self, task):
        return ["2"]


def test_verifier_timeout_during_replay_drops_only_that_retry(world_tokenizer):
    FlakyVerifierSuite.hang = False
    config = AgentLoopConfig(action_format="raw", step_timeout_s=0.2)
    loop = AgentLoop(FlakyVerifierSuite(), ScriptedEngine(world_tokenizer, lambda _: "3"), world_tokenizer, config)
    task = Task("t0", "What is 1+1?")
    base = loop.play_actions([EpisodeRequest(task=task)], [["3", "3", "3"]])[0]
    assert len(base.turns) == 3 and not base.success
    FlakyVerifierSuite.hang = True
    try:
        retries = loop.run([EpisodeRequest(task=task, prefix=base.turns[:1], guidance="answer 2")], SamplingParams(max_new_tokens=4))
    finally:
        FlakyVerifierSuite.hang = False
    [retry] = retries
    assert retry.end_reason == "replay_failed" and retry.reward_error and retry.reward == 0.0
    assert retry.guided_turn is None and ("Timeout" in retry.env_error)


def test_r3l_step_goes_on_when_a_replay_fails(world_tokenizer):
    """The policy reflects (retry from step 1); every replay then times out: the exploration completes,
    the retries are dropped and counted in rollout/replay_failures."""
    FlakyVerifierSuite.hang = False
    reflection = json.dumps({
        "trajectory_summary": "answered 3", "root_cause_analysis": "wrong sum", "trajectory_outcome": "failure",
        "improvement_suggestion": "answer 2", "retry_from_step": 1,
    })

    def reply(prompt):
        if "Reply with JSON only" in prompt:
            FlakyVerifierSuite.hang = True  # from now on the verifier hangs: the retries' replays fail
            return reflection
        return "3"

    loop = AgentLoop(FlakyVerifierSuite(), ScriptedEngine(world_tokenizer, reply), world_tokenizer,
                     AgentLoopConfig(action_format="raw", step_timeout_s=0.2))
    try:
        out = ReflectRetryExplorer().explore([Task("t0", "What is 1+1?")], loop, ExplorationSpec(4, SamplingParams(max_new_tokens=4)))
    finally:
        FlakyVerifierSuite.hang = False
    assert out.metrics["rollout/replay_failures"] == 2.0
    assert [t.origin for t in out.groups[0]] == ["base", "base"]  # no distilled sample from a failed replay


class CountingWorld(TaskSuite):
    """The procedural world, counting the actions its environments receive."""

    def __init__(self, inner):
        self.inner, self.received = inner, []
        self.system_prompt, self.max_turns = inner.system_prompt, inner.max_turns

    def make_env(self):
        env, received = self.inner.make_env(), self.received

        class Counting:
            def reset(self, task):
                return env.reset(task)

            def step(self, action):
                received.append(action)
                return env.step(action)

        return Counting()

    def train_task(self, index):
        return self.inner.train_task(index)

    def val_tasks(self):
        return self.inner.val_tasks()

    def demonstration(self, task):
        return self.inner.demonstration(task)


def test_malformed_prefix_turn_replays_its_format_feedback_without_stepping(world_suite, world_tokenizer):
    suite = CountingWorld(world_suite)
    task = world_suite.train_task(0)
    config = AgentLoopConfig()
    loop = AgentLoop(suite, ScriptedEngine(world_tokenizer, lambda _: render_action("look", config)), world_tokenizer, config)
    eos = world_tokenizer.eos_token_id
    malformed = world_tokenizer("no action here", add_special_tokens=False)["input_ids"] + [eos]
    look = world_tokenizer(render_action("look", config), add_special_tokens=False)["input_ids"] + [eos]
    base = loop.run_scripted([EpisodeRequest(task=task)], [[malformed, look, look, look]])[0]
    assert base.turns[0].malformed and not base.turns[1].malformed and base.invalid_actions == 1
    stepped_in_base = list(suite.received)
    assert "" not in stepped_in_base and len(stepped_in_base) == 3

    suite.received.clear()
    retry = loop.run([EpisodeRequest(task=task, prefix=base.turns[:2], guidance="take it")], SamplingParams(max_new_tokens=8))[0]
    # The replay stepped the environment on the valid prefix action only, never on the malformed one.
    assert suite.received[0] == "look" and "" not in suite.received
    # So the pivot observation, without guidance, is exactly the base episode's at that turn.
    assert retry.guided_turn.index == 2
    assert retry.guided_turn.unguided_context == base.turns[2].context_ids
    assert retry.invalid_actions >= 1  # the replayed malformed turn still counts as one
