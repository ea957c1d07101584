"""Reflect-GRPO: reflections on failures only, retries from scratch, distillation, metrics, preset."""

import importlib
import json
import re
from pathlib import Path

import lightning as L
import torch
import yaml
from scripted_engine import ScriptedEngine

from r3lightning.data.datamodule import RolloutDataModule, corpus_from_suite
from r3lightning.rollout.explorers import ExplorationSpec
from r3lightning.envs.math_env import MathSuite
from r3lightning.models import (
    ModelConfig,
    TinyModelSpec,
    build_tiny_model,
    build_tokenizer,
)
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.optim import OptimConfig
from r3lightning.module import R3LightningModule
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.rollout.engine import SamplingParams
from r3lightning.rollout.hf_engine import HFEngine
from r3lightning.rollout.reflect_from_scratch import ReflectFromScratchExplorer

ROOT = Path(__file__).resolve().parents[2]
REFLECTION = {
    "trajectory_summary": "s",
    "root_cause_analysis": "r",
    "trajectory_outcome": "failure",
    "improvement_suggestion": "GUIDANCE-MARKER",
    "retry_from_step": 1,
}


def world_player(suite, tasks, reflections, solved_on_base=()):
    """Replies for the procedural world: reflection prompts get the next of ``reflections``; guided
    episodes (and base episodes of tasks in ``solved_on_base``) follow the expert plan; the rest look."""
    plans = {t.prompt.split("\n")[0]: suite.demonstration(t) for t in tasks}
    solved = {tasks[i].prompt.split("\n")[0] for i in solved_on_base}
    queue = list(reflections)

    def reply(text):
        if "Review this attempt" in text:
            return queue.pop(0) if len(queue) > 1 else queue[0]
        goal = next(g for g in plans if g in text)
        if "[Guidance" in text or goal in solved:
            plan = plans[goal]
            return f"<action>{plan[sum(f'<action>{a}</action>' in text for a in plan)]}</action>"
        return "<action>look</action>"

    return reply


def explore(suite, tokenizer, tasks, reply, group_size=4, config=None):
    engine = ScriptedEngine(tokenizer, reply)
    loop = AgentLoop(suite, engine, tokenizer, config)
    return ReflectFromScratchExplorer().explore(tasks, loop, ExplorationSpec(group_size, SamplingParams())), engine


def test_failed_bases_retry_from_scratch_and_distill_without_guidance(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0), world_suite.train_task(1)]
    out, engine = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, [json.dumps(REFLECTION)]))
    assert [len(g) for g in out.groups] == [4, 4]  # 2 base + 2 distilled per task
    for group in out.groups:
        assert [t.origin for t in group] == ["base", "distilled", "base", "distilled"]
        for base, distilled in zip(group.trajectories[::2], group.trajectories[1::2]):
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
        "rollout/retry_rate": 1.0,
        "rollout/retry_unusable_rate": 0.0,
        "rollout/retry_improvement_rate": 1.0,
    }
    assert out.sft == []


def test_only_failures_are_reflected_and_metrics_are_exact(world_suite, world_tokenizer):
    """Task 0's bases succeed (no reflection), task 1's two fail: one valid reflection, one invalid."""
    tasks = [world_suite.train_task(0), world_suite.train_task(1)]
    reply = world_player(world_suite, tasks, [json.dumps(REFLECTION), "no idea"], solved_on_base=[0])
    out, engine = explore(world_suite, world_tokenizer, tasks, reply)
    assert sum("Review this attempt" in p for p in engine.prompts) == 2
    assert [t.origin for t in out.groups[0]] == ["base", "base"]
    assert [t.origin for t in out.groups[1]] == ["base", "distilled", "base"]
    assert out.metrics == {
        "rollout/reflection_rate": 2 / 4,
        "rollout/reflection_invalid_rate": 1 / 2,
        "rollout/retry_rate": 1 / 4,
        "rollout/retry_unusable_rate": 0.0,
        "rollout/retry_improvement_rate": 1.0,
    }


def test_malformed_reflections_are_counted_not_raised(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0)]
    bad = ["{broken", json.dumps({**REFLECTION, "retry_from_step": 99}), "", json.dumps([1, 2])]
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, bad), group_size=8)
    assert [t.origin for t in out.groups[0]] == ["base"] * 4
    assert out.metrics["rollout/reflection_invalid_rate"] == 1.0
    assert out.metrics["rollout/retry_rate"] == 0.0


def test_retry_whose_prompt_does_not_fit_is_counted(world_suite, world_tokenizer):
    """Guidance too long for the context: the retry ends before its first turn and cannot be used."""
    tasks = [world_suite.train_task(0)]
    long = json.dumps({**REFLECTION, "improvement_suggestion": "take the apple " * 200})
    config = AgentLoopConfig(max_context_tokens=600)
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, [long]), config=config)
    assert [t.origin for t in out.groups[0]] == ["base", "base"]
    assert out.metrics["rollout/retry_rate"] == 1.0
    assert out.metrics["rollout/retry_unusable_rate"] == 1.0
    assert out.metrics["rollout/retry_improvement_rate"] == 0.0


def test_untrained_policy_output_is_counted_never_raised(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    explorer = ReflectFromScratchExplorer(max_reflection_tokens=24)
    out = explorer.explore([world_suite.train_task(0)], loop, ExplorationSpec(4, SamplingParams(max_new_tokens=6)))
    base = [t for t in out.groups[0] if t.origin == "base"]
    distilled = [t for t in out.groups[0] if t.origin == "distilled"]
    assert len(base) == 2 and len(distilled) <= 2
    failures = sum(t.reward < 1.0 for t in base)
    assert out.metrics["rollout/reflection_rate"] == failures / 2
    assert out.metrics["rollout/retry_rate"] == (1 - out.metrics["rollout/reflection_invalid_rate"]) * failures / 2


def test_single_turn_math_retry_from_scratch():
    suite = MathSuite(source="arithmetic", num_val_tasks=4, instruction="")
    tokenizer = build_tokenizer(corpus_from_suite(suite, AgentLoopConfig(action_format="raw"), num_tasks=16), vocab_size=300)
    tasks = [suite.train_task(0)]

    def reply(text):
        if "Review this attempt" in text:
            return json.dumps({**REFLECTION, "retry_from_step": 0})
        a, op, b = re.search(r"Compute (\d+)([+-])(\d+)", text).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        return f"\\boxed{{{right if '[Guidance' in text else right + 1}}}"

    loop = AgentLoop(suite, ScriptedEngine(tokenizer, reply), tokenizer, AgentLoopConfig(action_format="raw"))
    out = ReflectFromScratchExplorer().explore(tasks, loop, ExplorationSpec(2, SamplingParams()))
    base, distilled = out.groups[0].trajectories
    assert (base.reward, distilled.reward, distilled.origin) == (0.0, 1.0, "distilled")
    assert distilled.turns[0].context_ids == ChatFormatter(tokenizer, suite.system_prompt).first_prompt(tasks[0].prompt)
    assert "GUIDANCE-MARKER" not in tokenizer.decode(distilled.token_ids())
    assert out.metrics["rollout/retry_improvement_rate"] == 1.0


# ---- the preset, one training step ---------------------------------------------------------------
def preset(name):
    """(AlgorithmConfig, explorer) exactly as configs/algorithms/<name>.yaml sets them."""
    cfg = yaml.safe_load((ROOT / "configs" / "algorithms" / f"{name}.yaml").read_text())
    module_name, class_name = cfg["data"]["explorer"]["class_path"].rsplit(".", 1)
    explorer = getattr(importlib.import_module(module_name), class_name)(**cfg["data"]["explorer"].get("init_args", {}))
    return AlgorithmConfig(**cfg["model"]["algorithm"]), explorer


class UseEngine(L.Callback):
    """Swaps the module's rollout engine for a scripted one once the model and tokenizer exist."""

    def __init__(self, make_reply):
        self.make_reply = make_reply

    def on_train_start(self, trainer, module):
        module.use_engine(ScriptedEngine(module.tokenizer, self.make_reply(trainer.datamodule.suite)))


def test_reflect_grpo_preset_trains_one_step(world_suite):
    algorithm, explorer = preset("reflect_grpo")
    assert isinstance(explorer, ReflectFromScratchExplorer)
    assert (algorithm.advantage, algorithm.pivotal_credit, algorithm.positive_amplification) == ("grpo", False, False)
    dm = RolloutDataModule(
        world_suite, explorer=explorer, group_size=4, tasks_per_step=2,
        sampling=SamplingParams(max_new_tokens=8), agent=AgentLoopConfig(max_context_tokens=768),
    )
    spec = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=400)
    module = R3LightningModule(model=ModelConfig(tiny=spec), algorithm=algorithm, optim=OptimConfig(lr=1e-3))
    tasks = [world_suite.train_task(i) for i in range(2)]
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[UseEngine(lambda suite: world_player(suite, tasks, [json.dumps(REFLECTION)]))],
    )
    trainer.fit(module, dm)
    origins = [t.origin for t in module.last_trajectories]
    assert origins.count("base") == 4 and origins.count("distilled") == 4
    assert all(t.pivot is None for t in module.last_trajectories)
    untrained = build_tiny_model(spec, module.tokenizer, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(module.policy.parameters(), untrained.parameters()))
    metrics = trainer.callback_metrics
    assert metrics["rollout/retry_rate"] == 1.0 and metrics["reward/mean_distilled"] == 1.0
    assert metrics["reward/mean_base"] == 0.0 and torch.isfinite(metrics["train/loss_rl"])
    assert module.skipped_steps == 0
