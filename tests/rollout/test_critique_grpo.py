"""Critique-GRPO: critiques of failures, refinements from scratch, the best one as an off-policy
sample, budget parity, metrics, the shaping loss in the module, and the preset."""

import pytest
import torch
from harness import LastStep, module_and_data, preset, quiet_trainer, weights_changed
from scripted_engine import ScriptedEngine, UseEngine, scripted_arithmetic, world_player

from r3lightning import algos
from r3lightning.rollout.explorers.base import ExplorationSpec
from r3lightning.data.collate import collate_experience
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
from r3lightning.rollout.chat import ChatFormatter
from r3lightning.rollout.explorers.critique_refine import CritiqueRefineExplorer, best_refinements
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.hf.engine import HFEngine
from r3lightning.types import Trajectory, Turn



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
        "rollout/refinement_dropped_rate": 0.0,
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


def test_refinements_that_do_not_improve_are_dropped(world_suite, world_tokenizer):
    """Two slots; the first refinement fails like its attempt (dropped, as the paper keeps only
    improving refinements), the second succeeds: one off-policy sample, the other slot a plain one."""
    tasks = [world_suite.train_task(0)]
    out, _ = explore(world_suite, world_tokenizer, tasks, world_player(world_suite, tasks, ["FAIL", "ok"]), num_refinements=2)
    assert [t.origin for t in out.groups[0]] == ["base", "base", "off_policy", "base"]
    assert out.groups[0].trajectories[2].reward == 1.0
    assert out.metrics["rollout/refinement_dropped_rate"] == 1 / 2 and out.metrics["rollout/refinement_fill_rate"] == 1 / 2


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
    suite, loop = scripted_arithmetic("CRITIQUE-MARKER recompute")
    tokenizer, tasks = loop.tokenizer, [suite.train_task(1)]
    out = CritiqueRefineExplorer().explore(tasks, loop, ExplorationSpec(4, SamplingParams()))
    group = out.groups[0].trajectories
    assert [(t.origin, t.reward) for t in group] == [("base", 0.0)] * 3 + [("off_policy", 1.0)]
    assert group[3].turns[0].context_ids == ChatFormatter(tokenizer, suite.system_prompt).first_prompt(tasks[0].prompt)
    assert "CRITIQUE-MARKER" not in tokenizer.decode(group[3].token_ids())


# ---- the module: shaping loss on off-policy rows, and the preset -------------------------------------
@pytest.fixture(scope="module")
def trained(world_suite):
    """One training step of the critique_grpo preset on the procedural world: every initial sample
    fails, every refinement succeeds. The module, the trainer and the step's trajectories."""
    algorithm, explorer = preset("critique_grpo")
    module, dm = module_and_data(
        world_suite, explorer=explorer, algorithm=algorithm, max_new_tokens=8, agent=AgentLoopConfig(max_context_tokens=768)
    )
    tasks = [world_suite.train_task(i) for i in range(2)]
    last = LastStep()
    trainer = quiet_trainer(1, callbacks=[UseEngine(lambda suite: world_player(suite, tasks, ["act on the goal"])), last])
    trainer.fit(module, dm)
    return module, trainer, last.output["trajectories"]


def test_critique_grpo_preset_trains_one_step(trained):
    module, trainer, trajectories = trained
    assert isinstance(module.trainer.datamodule.explorer, CritiqueRefineExplorer)
    algorithm = module.algorithm
    assert (algorithm.advantage, algorithm.policy_loss, algorithm.off_policy_gamma) == ("dr_grpo", "ppo_clip", 0.1)
    assert algorithm.aggregation == "seq_mean_token_sum"  # the paper: no division by the response length
    origins = [t.origin for t in trajectories]
    assert origins == ["base", "base", "base", "off_policy"] * 2
    assert any(weights_changed(module))
    metrics = trainer.callback_metrics
    assert metrics["rollout/critique_rate"] == 1.0 and metrics["reward/mean_off_policy"] == 1.0
    assert torch.isfinite(metrics["train/loss_rl"]) and module.skipped_steps == 0


def test_off_policy_rows_get_the_shaping_loss_and_no_ratio(trained):
    """Hand-computed loss of one base row (PPO clip) and one off-policy row (−A·π/(π+γ)); the
    off-policy row's behaviour log-probs are absurd on purpose and must not matter."""
    module, _, trajectories = trained
    base, refinement = trajectories[0], trajectories[3]
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
        logp = module.prefix_forward.sequence_logprobs(module.policy, experience).logp
        ratio = torch.exp(logp[0] - experience.old_logprobs[0, 1:])
        adv = experience.advantages[:, 1:]
        clipped = -torch.minimum(ratio * adv[0], ratio.clamp(0.8, 1.2) * adv[0])
        prob = logp[1].exp()
        shaped = -adv[1] * prob / (prob + 0.1)
        # seq_mean_token_sum: each row's token sum, averaged over the rows
        expected = ((clipped * mask[0]).sum() + (shaped * mask[1]).sum()) / totals["rl_seqs"]
    torch.testing.assert_close(out["loss_rl"].detach(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shaped, algos.shaped_off_policy_loss(logp[1:], adv[1:], 0.1)[0])
    assert out["ratio_count"] == mask[0].sum()  # only the base row's tokens have a ratio
    torch.testing.assert_close(out["ratio_sum"], (ratio * mask[0]).sum())
