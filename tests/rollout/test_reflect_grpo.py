"""Reflect-GRPO as the R³L reference code runs it: N fresh samples, reflections on the failed ones of
the second half, retries from scratch (none after a "success" verdict), distillation, metrics, preset."""

import json

import pytest
import torch
from harness import LastStep, module_and_data, preset, quiet_trainer, weights_changed
from scripted_engine import LOOK, ScriptedEngine, UseEngine, scripted_arithmetic, world_player

from r3lightning.rollout.explorers.base import ExplorationSpec
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.rollout.explorers.reflect_from_scratch import ReflectFromScratchExplorer

REFLECTION = {
    "trajectory_summary": "s",
    "root_cause_analysis": "r",
    "trajectory_outcome": "failure",
    "improvement_suggestion": "GUIDANCE-MARKER",
    "retry_from_step": 1,
}


def explore(suite, tokenizer, tasks, reply, group_size=4, config=None):
    engine = ScriptedEngine(tokenizer, reply)
    loop = AgentLoop(suite, engine, tokenizer, config)
    return ReflectFromScratchExplorer().explore(tasks, loop, ExplorationSpec(group_size, SamplingParams())), engine


def test_failed_bases_retry_from_scratch_and_distill_without_guidance(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0), world_suite.train_task(1)]
    out, engine = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, [json.dumps(REFLECTION)]))
    assert [len(g) for g in out.groups] == [6, 6]  # 4 fresh + a retry for each failed sample of the second half
    for group in out.groups:
        assert [t.origin for t in group] == ["base"] * 4 + ["distilled"] * 2
        for base, distilled in zip(group.trajectories[2:4], group.trajectories[4:]):
            assert not base.success and distilled.success
            assert base.pivot is None and distilled.pivot is None
            text = world_tokenizer.decode(distilled.token_ids())
            assert "GUIDANCE-MARKER" not in text and "Guidance" not in text
            # From scratch: nothing replayed (the base looked first, the retry acts on the task at once),
            # and the first turn's context is the plain prompt the base saw.
            assert distilled.turns[0] is not base.turns[0] and distilled.actions[0] != "look"
            assert distilled.turns[0].context_ids == base.turns[0].context_ids
            assert distilled.guided_turn is None
    guided = [p for p in engine.prompts if "GUIDANCE-MARKER" in p]
    # Every retry was shown the guidance in its very first prompt (one user message, no earlier turn).
    assert sum(p.count("<|im_start|>user") == 1 for p in guided) == 4
    assert out.metrics == {
        "rollout/reflection_rate": 1.0,
        "rollout/reflection_invalid_rate": 0.0,
        "rollout/reflection_claims_success_rate": 0.0,
        "rollout/retry_rate": 1.0,
        "rollout/retry_unusable_rate": 0.0,
        "rollout/retry_improvement_rate": 1.0,
    }
    assert out.sft == []


def test_only_failures_of_the_second_half_are_reflected_and_metrics_are_exact(world_suite, world_tokenizer):
    """Task 0's samples succeed (no reflection); task 1's fail: its two candidates get one valid
    reflection and one invalid."""
    tasks = [world_suite.train_task(0), world_suite.train_task(1)]
    reply = world_player(world_suite, tasks, [json.dumps(REFLECTION), "no idea"], solved_on_base=[0])
    out, engine = explore(world_suite, world_tokenizer, tasks, reply)
    assert sum("Review this attempt" in p for p in engine.prompts) == 2
    assert [t.origin for t in out.groups[0]] == ["base"] * 4
    assert [t.origin for t in out.groups[1]] == ["base"] * 4 + ["distilled"]
    assert out.metrics == {
        "rollout/reflection_rate": 2 / 4,
        "rollout/reflection_invalid_rate": 1 / 2,
        "rollout/reflection_claims_success_rate": 0.0,
        "rollout/retry_rate": 1 / 4,
        "rollout/retry_unusable_rate": 0.0,
        "rollout/retry_improvement_rate": 1.0,
    }


def test_a_success_verdict_means_no_retry(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0)]
    claims = json.dumps({**REFLECTION, "trajectory_outcome": "success"})
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, [claims]))
    assert [t.origin for t in out.groups[0]] == ["base"] * 4
    assert out.metrics["rollout/reflection_claims_success_rate"] == 1.0 and out.metrics["rollout/retry_rate"] == 0.0


def test_malformed_reflections_are_counted_not_raised(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0)]
    bad = ["{broken", json.dumps({**REFLECTION, "retry_from_step": 99}), "", json.dumps([1, 2])]
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, bad), group_size=8)
    assert [t.origin for t in out.groups[0]] == ["base"] * 8
    assert out.metrics["rollout/reflection_invalid_rate"] == 1.0
    assert out.metrics["rollout/retry_rate"] == 0.0


def test_retry_whose_prompt_does_not_fit_is_counted(world_suite, world_tokenizer):
    """Guidance too long for the context: the retry ends before its first turn and cannot be used."""
    tasks = [world_suite.train_task(0)]
    long = json.dumps({**REFLECTION, "improvement_suggestion": "take the apple " * 200})
    config = AgentLoopConfig(max_context_tokens=600)
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, [long]), config=config)
    assert [t.origin for t in out.groups[0]] == ["base"] * 4
    assert out.metrics["rollout/retry_rate"] == 1.0
    assert out.metrics["rollout/retry_unusable_rate"] == 1.0
    assert out.metrics["rollout/retry_improvement_rate"] == 0.0


def test_untrained_policy_output_is_counted_never_raised(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    explorer = ReflectFromScratchExplorer(max_reflection_tokens=24)
    out = explorer.explore([world_suite.train_task(0)], loop, ExplorationSpec(4, SamplingParams(max_new_tokens=6)))
    base = [t for t in out.groups[0] if t.origin == "base"]
    distilled = [t for t in out.groups[0] if t.origin == "distilled"]
    assert len(base) == 4 and len(distilled) <= 2
    failures = sum(t.reward < 1.0 for t in base[2:])  # the candidates: the second half
    assert out.metrics["rollout/reflection_rate"] == failures / 2
    valid = 1 - out.metrics["rollout/reflection_invalid_rate"] - out.metrics["rollout/reflection_claims_success_rate"]
    assert out.metrics["rollout/retry_rate"] == pytest.approx(valid * failures / 2)


def test_single_turn_math_retry_from_scratch():
    suite, loop = scripted_arithmetic(json.dumps({**REFLECTION, "retry_from_step": 0}))
    tokenizer, tasks = loop.tokenizer, [suite.train_task(0)]
    out = ReflectFromScratchExplorer().explore(tasks, loop, ExplorationSpec(2, SamplingParams()))
    _, base, distilled = out.groups[0].trajectories  # the second of the 2 fresh samples is the candidate
    assert (base.reward, distilled.reward, distilled.origin) == (0.0, 1.0, "distilled")
    assert distilled.turns[0].context_ids == ChatFormatter(tokenizer, suite.system_prompt).first_prompt(tasks[0].prompt)
    assert "GUIDANCE-MARKER" not in tokenizer.decode(distilled.token_ids())
    assert out.metrics["rollout/retry_improvement_rate"] == 1.0


# ---- the preset, one training step ---------------------------------------------------------------
def test_reflect_grpo_preset_trains_one_step(world_suite):
    algorithm, explorer = preset("reflect_grpo")
    assert isinstance(explorer, ReflectFromScratchExplorer)
    assert (algorithm.advantage, algorithm.pivotal_credit, algorithm.positive_amplification) == ("grpo", False, False)
    assert (algorithm.policy_loss, algorithm.kl_coef, algorithm.kl_estimator, algorithm.recompute_old_logprobs) == (
        "ppo_clip", 0.01, "k3", True
    )
    module, dm = module_and_data(
        world_suite, explorer=explorer, algorithm=algorithm, max_new_tokens=8, agent=AgentLoopConfig(max_context_tokens=768)
    )
    tasks = [world_suite.train_task(i) for i in range(2)]
    last = LastStep()
    trainer = quiet_trainer(1, callbacks=[UseEngine(lambda suite: world_player(suite, tasks, [json.dumps(REFLECTION)])), last])
    trainer.fit(module, dm)
    origins = [t.origin for t in last.output["trajectories"]]
    assert origins.count("base") == 8 and origins.count("distilled") == 4
    assert all(t.pivot is None for t in last.output["trajectories"])
    assert any(weights_changed(module))
    metrics = trainer.callback_metrics
    assert metrics["rollout/retry_rate"] == 1.0 and metrics["reward/mean_distilled"] == 1.0
    assert metrics["reward/mean_base"] == 0.0 and torch.isfinite(metrics["train/loss_rl"])
    assert module.skipped_steps == 0


def test_text_reflections_drive_retries_from_scratch(world_suite, world_tokenizer):
    """``reflection_format: text`` (a small pretrained policy's free text): the text is the guidance of a
    retry from scratch; a text judges nothing, so every failed candidate is retried."""
    tasks = [world_suite.train_task(0)]
    def reply(text):
        return "Check the desk first, TEXT-MARKER." if "say what went wrong" in text else LOOK

    engine = ScriptedEngine(world_tokenizer, reply)
    loop = AgentLoop(world_suite, engine, world_tokenizer)
    out = ReflectFromScratchExplorer(reflection_format="text").explore(tasks, loop, ExplorationSpec(4, SamplingParams()))
    assert [t.origin for t in out.groups[0]] == ["base"] * 4 + ["distilled"] * 2
    guided = [p for p in engine.prompts if "TEXT-MARKER" in p]
    assert all("Advice from a review of an earlier attempt: Check the desk first, TEXT-MARKER." in p for p in guided)
    assert sum(p.count("<|im_start|>user") == 1 for p in guided) == 2  # two retries, shown it from their first turn
    assert out.metrics["rollout/reflection_invalid_rate"] == 0.0 and out.metrics["rollout/retry_rate"] == 1.0
    with pytest.raises(ValueError, match="reflection_format"):
        ReflectFromScratchExplorer(reflection_format="yaml")
