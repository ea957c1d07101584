"""Critique-GRPO: critiques of failures, refinements from scratch, the best one as an off-policy
sample, budget parity, metrics, the shaping loss in the module, and the preset."""

import importlib
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from scripted_engine import ScriptedEngine

from r3lightning import algos
from r3lightning.rollout.explorers import ExplorationSpec
from r3lightning.data.collate import collate_experience
from r3lightning.data.datamodule import RolloutDataModule, corpus_from_suite
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
from r3lightning.rollout.critique_refine import CritiqueRefineExplorer, best_refinements
from r3lightning.rollout.engine import SamplingParams
from r3lightning.rollout.hf_engine import HFEngine
from r3lightning.types import Trajectory, Turn

ROOT = Path(__file__).resolve().parents[2]
SPEC = TinyModelSpec(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=400)


def world_player(suite, tasks, critiques, solved_on_base=(), look_first=()):
    """Replies for the procedural world: critique prompts get the next of ``critiques`` (the last one
    repeats); a refinement follows the expert plan unless its critique says FAIL, after one look when
    its critique names a marker in ``look_first``; base episodes of ``solved_on_base`` tasks follow the
    plan; everything else looks."""
    plans = {t.prompt.split("\n")[0]: suite.demonstration(t) for t in tasks}
    solved = {tasks[i].prompt.split("\n")[0] for i in solved_on_base}
    queue = list(critiques)

    def reply(text):
        if "Critique this attempt" in text:
            return queue.pop(0) if len(queue) > 1 else queue[0]
        goal = next(g for g in plans if g in text)
        refining = "[Guidance" in text
        if (refining and "FAIL" in text) or (not refining and goal not in solved):
            return "<action>look</action>"
        looked = text.count("<action>look</action>") > 1  # the system prompt shows it once as an example
        if any(marker in text for marker in look_first) and not looked:
            return "<action>look</action>"
        plan = plans[goal]
        return f"<action>{plan[sum(f'<action>{a}</action>' in text for a in plan)]}</action>"

    return reply


def explore(suite, tokenizer, tasks, reply, group_size=4, config=None, **explorer_args):
    engine = ScriptedEngine(tokenizer, reply)
    loop = AgentLoop(suite, engine, tokenizer, config)
    return CritiqueRefineExplorer(**explorer_args).explore(tasks, loop, ExplorationSpec(group_size, SamplingParams())), engine


def test_group_keeps_its_size_with_one_off_policy_refinement(world_suite, world_tokenizer):
    """Task 0 is solved at once (nothing to critique: its slot gets a plain sample); task 1 fails three
    times, is critiqued three times, and its first refinement (all succeed) joins as off-policy."""
    tasks = [world_suite.train_task(0), world_suite.train_task(1)]
    reply = world_player(world_suite, tasks, ["CRITIQUE-MARKER take it"], solved_on_base=[0])
    out, engine = explore(world_suite, world_tokenizer, tasks, reply)
    assert [len(g) for g in out.groups] == [4, 4]
    assert [t.origin for t in out.groups[0]] == ["base"] * 4 and all(t.success for t in out.groups[0])
    assert [t.origin for t in out.groups[1]] == ["base", "base", "base", "off_policy"]
    initial, refinement = out.groups[1].trajectories[0], out.groups[1].trajectories[3]
    assert not initial.success and refinement.success and refinement.pivot is None
    text = world_tokenizer.decode(refinement.token_ids())
    assert "CRITIQUE-MARKER" not in text and "Critique" not in text and "Previous attempt" not in text
    # Scored under the plain prompt, and from scratch: no turn of the initial sample is replayed.
    assert refinement.turns[0].context_ids == initial.turns[0].context_ids
    assert refinement.actions == world_suite.demonstration(tasks[1])
    critique_prompts = [p for p in engine.prompts if "Critique this attempt" in p]
    assert len(critique_prompts) == 3 and all("Step 0: look -> You look around." in p for p in critique_prompts)
    refining_first = [p for p in engine.prompts if "CRITIQUE-MARKER" in p and p.count("<|im_start|>user") == 1]
    assert len(refining_first) == 3 and all("Step 3: look" in p for p in refining_first)  # the attempt is shown
    assert out.metrics == {
        "rollout/critique_rate": 3 / 6,
        "rollout/critique_empty_rate": 0.0,
        "rollout/refinement_unusable_rate": 0.0,
        "rollout/refinement_improvement_rate": 3 / 3,
        "rollout/refinement_fill_rate": 1 / 2,
    }


def test_best_refinement_is_highest_reward_and_first_on_ties(world_suite, world_tokenizer):
    """Critique 1 leads to a failure, 2 to a success after one extra look, 3 to a direct success:
    2 and 3 tie on reward, so the earlier one (with the look) is kept."""
    tasks = [world_suite.train_task(0)]
    critiques = ["FAIL", "LOOK-FIRST then act", "act at once"]
    reply = world_player(world_suite, tasks, critiques, look_first=["LOOK-FIRST"])
    out, _ = explore(world_suite, world_tokenizer, tasks, reply)
    kept = out.groups[0].trajectories[3]
    assert kept.origin == "off_policy" and kept.reward == 1.0
    assert kept.actions == ["look", *world_suite.demonstration(tasks[0])]
    assert out.metrics["rollout/refinement_improvement_rate"] == 2 / 3


def test_best_refinements_orders_by_reward_and_keeps_ties_in_order():
    candidates = [Trajectory(f"t{i}", [Turn([1], [2])], reward=r) for i, r in enumerate([0.0, 1.0, 0.5, 1.0])]
    assert [t.task_id for t in best_refinements(candidates, 1)] == ["t1"]
    assert [t.task_id for t in best_refinements(candidates, 3)] == ["t1", "t3", "t2"]
    assert best_refinements(candidates[:1], 2) == candidates[:1]


def test_two_refinement_slots(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0)]
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, ["FAIL", "ok"]), num_refinements=2)
    assert [t.origin for t in out.groups[0]] == ["base", "base", "off_policy", "off_policy"]
    assert [t.reward for t in out.groups[0].trajectories[2:]] == [1.0, 0.0]  # best first


def test_empty_critiques_are_counted_and_their_slot_filled(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0)]
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, ["   "]))
    assert [t.origin for t in out.groups[0]] == ["base"] * 4
    assert out.metrics["rollout/critique_empty_rate"] == 1.0
    assert out.metrics["rollout/refinement_fill_rate"] == 1.0


def test_refinement_whose_prompt_does_not_fit_is_counted(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0)]
    reply = world_player(world_suite, tasks, ["take the apple " * 200])
    out, _ = explore(world_suite, world_tokenizer, tasks, reply, config=AgentLoopConfig(max_context_tokens=600))
    assert [t.origin for t in out.groups[0]] == ["base"] * 4
    assert out.metrics["rollout/refinement_unusable_rate"] == 1.0
    assert out.metrics["rollout/refinement_fill_rate"] == 1.0


def test_too_many_refinement_slots_is_a_clear_error(world_suite, world_tokenizer):
    tasks = [world_suite.train_task(0)]
    with pytest.raises(ValueError, match="num_refinements"):
        explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, ["x"]), group_size=2, num_refinements=2)
    with pytest.raises(ValueError, match="num_refinements"):
        CritiqueRefineExplorer(num_refinements=0)


def test_untrained_policy_output_is_counted_never_raised(world_suite, world_tokenizer, world_policy):
    loop = AgentLoop(world_suite, HFEngine(world_policy, world_tokenizer), world_tokenizer)
    explorer = CritiqueRefineExplorer(max_critique_tokens=24)
    out = explorer.explore([world_suite.train_task(0)], loop, ExplorationSpec(4, SamplingParams(max_new_tokens=6)))
    origins = [t.origin for t in out.groups[0]]
    assert len(origins) == 4 and origins[:3] == ["base"] * 3 and origins[3] in ("base", "off_policy")
    assert out.metrics["rollout/refinement_fill_rate"] == float(origins[3] == "base")


def test_single_turn_math_refinement():
    suite = MathSuite(source="arithmetic", num_val_tasks=4, instruction="")
    tokenizer = build_tokenizer(corpus_from_suite(suite, AgentLoopConfig(action_format="raw"), num_tasks=16), vocab_size=300)
    tasks = [suite.train_task(1)]

    def reply(text):
        if "Critique this attempt" in text:
            return "CRITIQUE-MARKER recompute"
        a, op, b = re.search(r"Compute (\d+)([+-])(\d+)", text).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        return f"\\boxed{{{right if '[Guidance' in text else right + 1}}}"

    loop = AgentLoop(suite, ScriptedEngine(tokenizer, reply), tokenizer, AgentLoopConfig(action_format="raw"))
    out = CritiqueRefineExplorer().explore(tasks, loop, ExplorationSpec(4, SamplingParams()))
    group = out.groups[0].trajectories
    assert [(t.origin, t.reward) for t in group] == [("base", 0.0)] * 3 + [("off_policy", 1.0)]
    assert group[3].turns[0].context_ids == ChatFormatter(tokenizer, suite.system_prompt).first_prompt(tasks[0].prompt)
    assert "CRITIQUE-MARKER" not in tokenizer.decode(group[3].token_ids())


# ---- the module: shaping loss on off-policy rows, and the preset -------------------------------------
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


@pytest.fixture(scope="module")
def trained(world_suite):
    """One training step of the critique_grpo preset on the procedural world: every initial sample
    fails, every refinement succeeds."""
    algorithm, explorer = preset("critique_grpo")
    dm = RolloutDataModule(
        world_suite, explorer=explorer, group_size=4, tasks_per_step=2,
        sampling=SamplingParams(max_new_tokens=8), agent=AgentLoopConfig(max_context_tokens=768),
    )
    module = R3LightningModule(model=ModelConfig(tiny=SPEC), algorithm=algorithm, optim=OptimConfig(lr=1e-3))
    tasks = [world_suite.train_task(i) for i in range(2)]
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[UseEngine(lambda suite: world_player(suite, tasks, ["act on the goal"]))],
    )
    trainer.fit(module, dm)
    return module, trainer


def test_critique_grpo_preset_trains_one_step(trained):
    module, trainer = trained
    assert isinstance(module.trainer.datamodule.explorer, CritiqueRefineExplorer)
    algorithm = module.algorithm
    assert (algorithm.advantage, algorithm.policy_loss, algorithm.off_policy_gamma) == ("grpo", "ppo_clip", 0.1)
    origins = [t.origin for t in module.last_trajectories]
    assert origins == ["base", "base", "base", "off_policy"] * 2
    untrained = build_tiny_model(SPEC, module.tokenizer, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(module.policy.parameters(), untrained.parameters()))
    metrics = trainer.callback_metrics
    assert metrics["rollout/critique_rate"] == 1.0 and metrics["reward/mean_off_policy"] == 1.0
    assert torch.isfinite(metrics["train/loss_rl"]) and module.skipped_steps == 0


def test_off_policy_rows_get_the_shaping_loss_and_no_ratio(trained):
    """Hand-computed loss of one base row (PPO clip) and one off-policy row (−A·π/(π+γ)); the
    off-policy row's behaviour log-probs are absurd on purpose and must not matter."""
    module, _ = trained
    base, refinement = module.last_trajectories[0], module.last_trajectories[3]
    assert refinement.origin == "off_policy"
    experience = collate_experience([base, refinement], [-0.5, 1.5], module.tokenizer.pad_token_id, pivotal_credit=False)
    experience.old_logprobs[1] = -200.0  # exp(logπ + 200) overflows: the ratio branch must not be used
    mask = experience.loss_mask[:, 1:]
    totals = {"rl_tokens": float(mask.sum()), "rl_seqs": 2.0, "sft_tokens": 0.0}
    module.policy.zero_grad()
    out = module.micro_batch_loss(experience, totals)
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in module.policy.parameters() if p.grad is not None)
    with torch.no_grad():
        logp, _ = module.sequence_logprobs(module.policy, experience)
        ratio = torch.exp(logp[0] - experience.old_logprobs[0, 1:])
        adv = experience.advantages[:, 1:]
        clipped = -torch.minimum(ratio * adv[0], ratio.clamp(0.8, 1.2) * adv[0])
        prob = logp[1].exp()
        shaped = -adv[1] * prob / (prob + 0.1)
        expected = ((clipped * mask[0]).sum() + (shaped * mask[1]).sum()) / mask.sum()
    torch.testing.assert_close(out["loss_rl"].detach(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shaped, algos.shaped_off_policy_loss(logp[1:], adv[1:], 0.1)[0])
    assert out["ratio_count"] == mask[0].sum()  # only the base row's tokens have a ratio
    torch.testing.assert_close(out["ratio_sum"], (ratio * mask[0]).sum())
