"""Every environment call has the agent loop's deadline and checks, whoever makes it: the tokenizer's
corpus, scripted warm-start data, replays; a malformed result names the suite, the method and what was
wrong; a turn's hanging calls are cut together (issue 38, items 1 and 6)."""

import threading

import pytest
from hanging_suite import FaultySuite
from scripted_engine import ScriptedEngine

from r3lightning.data.datamodule import RolloutDataModule, corpus_from_suite
from r3lightning.envs.base import StepResult, Task, TaskSuite
from r3lightning.envs.safety import CallTimeout
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest
from r3lightning.engines.base import SamplingParams
from r3lightning.rollout.env_calls import EnvCaller, EnvCallError

AGENT = AgentLoopConfig(action_format="raw", step_timeout_s=0.3)


@pytest.mark.parametrize(
    "fault, method, message",
    [
        ("raise", "step", r"FaultySuite: FaultyEnv.step \(task 'faulty#0'\) failed: RuntimeError: simulator crashed"),
        ("hang", "step", r"FaultySuite: FaultyEnv.step \(task 'faulty#0'\) failed: CallTimeout: .* did not return within 0.3s"),
        ("hang", "reset", r"FaultySuite: FaultyEnv.reset \(task 'faulty#0'\) failed: CallTimeout"),
        ("tuple", "step", r"FaultySuite: FaultyEnv.step \(task 'faulty#0'\) returned tuple \(a gym-style"),
        ("info_none", "step", r"FaultySuite: FaultyEnv.step \(task 'faulty#0'\): StepResult.info is NoneType, expected dict"),
        ("observation_none", "step", r"FaultySuite: FaultyEnv.step \(task 'faulty#0'\): StepResult.observation is NoneType"),
        ("tuple", "reset", r"FaultySuite: FaultyEnv.reset \(task 'faulty#0'\) returned tuple"),
    ],
    ids=["step-raises", "step-hangs", "reset-hangs", "gym-tuple", "info-none", "observation-none", "reset-tuple"],
)
def test_the_tokenizer_corpus_calls_the_environment_under_the_deadline_and_checks(fault, method, message):
    suite = FaultySuite(fault, method)
    try:
        with pytest.raises(EnvCallError, match=r"^data.suite: building the tokenizer's corpus: " + message):
            corpus_from_suite(suite, AGENT, num_tasks=2)
    finally:
        suite.release.set()


def test_a_faulty_corpus_is_one_line_through_r3l_fit(tmp_path, capsys):
    from test_bad_input import run_cli

    code, err = run_cli(
        tmp_path, capsys, "--data.suite=hanging_suite.FaultySuite", "--data.suite.init_args.fault=info_none",
        "--trainer.max_steps=1", "--data.agent.action_format=raw",
    )
    assert code == 1 and "Traceback" not in err
    assert "r3l: error: data.suite: building the tokenizer's corpus: FaultySuite: FaultyEnv.step (task 'faulty#0'): StepResult.info is NoneType" in err


def test_max_turns_none_is_refused_when_the_suite_is_configured(world_tokenizer):
    suite = FaultySuite(max_turns=None)
    with pytest.raises(ValueError, match=r"data.suite: FaultySuite.max_turns is None; it must be a whole number >= 1"):
        RolloutDataModule(suite)
    with pytest.raises(ValueError, match=r"FaultySuite.max_turns is None"):
        AgentLoop(suite, ScriptedEngine(world_tokenizer, lambda _: "4"), world_tokenizer, AGENT)


def test_scripted_warm_start_data_skips_and_counts_a_task_whose_environment_fails(world_suite, world_tokenizer):
    """The mistakes of scripted reflection samples are chosen by replaying the expert plan; a replay whose
    step hangs loses that task's sample (counted in the loop's env_calls.failures), not the run."""
    import random

    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer
    from r3lightning.rollout.warmstart import scripted_reflection_samples

    loop = AgentLoop(world_suite, ScriptedEngine(world_tokenizer, lambda _: "look"), world_tokenizer,
                     AgentLoopConfig(step_timeout_s=0.3))
    tasks = [world_suite.train_task(i) for i in range(2)]
    release = threading.Event()
    make_env = world_suite.make_env

    def hanging_env():
        env = make_env()
        env.step = lambda action: release.wait() and None
        return env

    world_suite.make_env = hanging_env
    try:
        samples = scripted_reflection_samples(loop, ReflectRetryExplorer().reflector, tasks, random.Random(0))
    finally:
        world_suite.make_env = make_env
        release.set()
    assert samples == [] and loop.env_calls.failures >= 1


class BarrierSuite(TaskSuite):
    """Replaying the action ``again`` waits until ``parties`` replays wait together (a verifier that
    hangs unless its calls run side by side); any other action is right."""

    system_prompt, max_turns = "Answer.", 3

    def __init__(self, parties):
        self.barrier = threading.Barrier(parties)

    def make_env(self):
        suite = self

        class Env:
            def reset(self, task):
                return "What is 1+1?"

            def step(self, action):
                if action == "again":
                    suite.barrier.wait(timeout=10)
                    return StepResult("Try again.", 0.0, False, {})
                return StepResult("Correct.", 1.0, True, {"success": True})

        return Env()

    def train_task(self, index):
        return Task(f"t{index}", "What is 1+1?")

    def val_tasks(self):
        return [self.train_task(0)]

    def demonstration(self, task):
        return ["2"]


def test_a_turns_hanging_replays_are_cut_together_not_one_deadline_each(world_tokenizer):
    """Four retries whose replayed step hangs until all four run side by side: replayed one after another,
    each waits alone past its deadline (three are lost); handed over together, the ones not yet started
    run at once when the batch overruns, so at most the first is lost."""
    suite = BarrierSuite(parties=4)
    loop = AgentLoop(suite, ScriptedEngine(world_tokenizer, lambda _: "2"), world_tokenizer, AgentLoopConfig(action_format="raw", step_timeout_s=0.3))
    [played] = loop.play_actions([EpisodeRequest(task=suite.train_task(0))], [["x"]], allow_unfinished=True)
    prefix = [played.turns[0].__class__(**{**played.turns[0].__dict__, "action": "again"})]
    try:
        retries = loop.run([EpisodeRequest(task=suite.train_task(0), prefix=prefix) for _ in range(4)], SamplingParams(max_new_tokens=4))
    finally:
        suite.barrier.abort()
    assert sum(r.end_reason == "replay_failed" for r in retries) <= 1
    assert sum(r.success for r in retries) >= 3


def test_calls_left_unstarted_when_a_batch_overruns_run_side_by_side():
    barrier = threading.Barrier(4)
    try:
        out = EnvCaller().call_each([(lambda: barrier.wait(timeout=10), ()) for _ in range(4)], timeout_s=0.3)
    finally:
        barrier.abort()
    timeouts = [value for ok, value in out if not ok]
    assert len(timeouts) <= 1 and all(isinstance(t, CallTimeout) for t in timeouts)
