"""R³ in training: the buffer restored exactly on resume, replay/ranking/in-context figures logged,
and the in-context explorer's prompts."""

import random
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from digit_suite import DigitSuite
from harness import module_and_data, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from scripted_engine import ScriptedEngine

from r3lightning.algos.objective import AlgorithmConfig, RankingConfig
from r3lightning.data.replay import ReplayBuffer, ReplayConfig, record_step
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
from r3lightning.engines.base import SamplingParams
from r3lightning.rollout.explorers.base import ExplorationSpec
from r3lightning.rollout.explorers.in_context import InContextReflectionExplorer
from r3lightning.types import Group, Trajectory, Turn

N = 3


class FewDigitTasks(DigitSuite):
    """Three tasks, visited again and again, so the buffer has history to replay."""

    def train_task(self, index):
        return super().train_task(index % 3)


def make():
    module, dm = module_and_data(
        FewDigitTasks(),
        seed=5,
        algorithm=AlgorithmConfig(policy_loss="ppo_clip", ranking=RankingConfig(enabled=True, delta=0.3, window=1)),
        explorer=InContextReflectionExplorer(share=0.5, after_failures=1),
        group_size=2,
        lr=3e-3,
    )
    dm.replay = ReplayConfig(enabled=True, into_all_success=True)
    dm.buffer = ReplayBuffer(dm.replay.max_per_task, dm.replay.max_total)
    return module, dm


class Figures(L.Callback):
    def __init__(self):
        self.rows = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        names = ("reward/mean", "replay/injected", "replay/size", "activity/ranking_bonus_abs_mean", "rollout/in_context_task_rate")
        self.rows[trainer.global_step] = {k: float(trainer.callback_metrics[k]) for k in names}


def fit(module, dm, steps, ckpt_path=None, callbacks=()):
    figures = Figures()
    trainer = quiet_trainer(steps, enable_checkpointing=bool(callbacks), deterministic=True, callbacks=[figures, *callbacks])
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return figures.rows


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("r3_resume")
    L.seed_everything(0)
    module, dm = make()
    saver = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=N, save_top_k=-1)
    rows = fit(module, dm, 2 * N, callbacks=[saver])
    return SimpleNamespace(module=module, dm=dm, rows=rows, checkpoint=str(root / f"step={N}.ckpt"))


def test_r3_figures_are_logged_and_the_buffer_fills(straight_run):
    rows = straight_run.rows
    assert rows[1]["replay/size"] > 0 and rows[2 * N]["replay/size"] >= rows[1]["replay/size"]
    assert sum(r["replay/injected"] for r in rows.values()) > 0, "a flat group should have been rescued"
    assert all(0.0 <= r["activity/ranking_bonus_abs_mean"] <= 0.15 + 1e-6 for r in rows.values())
    assert any(r["activity/ranking_bonus_abs_mean"] > 0 for r in rows.values()), "the ranking never acted"
    assert any(r["rollout/in_context_task_rate"] > 0 for r in rows.values())


def test_two_n_steps_equal_n_plus_resume_plus_n_with_replay(straight_run):
    L.seed_everything(1234)
    resumed, resumed_dm = make()
    rows = fit(resumed, resumed_dm, 2 * N, ckpt_path=straight_run.checkpoint)
    assert rows == {k: v for k, v in straight_run.rows.items() if k > N}
    assert resumed_dm.buffer.state_dict() == straight_run.dm.buffer.state_dict()
    a, b = straight_run.module.policy.state_dict(), resumed.policy.state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)


def test_in_context_samples_show_a_past_failure_after_a_failure_streak(world_tokenizer):
    suite = FewDigitTasks()
    engine = ScriptedEngine(world_tokenizer, lambda prompt: "seven")
    loop = AgentLoop(suite, engine, world_tokenizer, AgentLoopConfig(action_format="raw"))
    task = suite.train_task(0)
    history = ReplayBuffer(4, 100)
    spec = ExplorationSpec(4, SamplingParams(max_new_tokens=4), history=history, rng=random.Random(0))
    explorer = InContextReflectionExplorer(share=0.5, after_failures=2)
    first = explorer.explore([task], loop, spec)
    assert [t.origin for t in first.groups[0]] == ["base"] * 4  # no history yet
    failed = Trajectory(task.task_id, [Turn([1], world_tokenizer("nine", add_special_tokens=False)["input_ids"], None, feedback="Wrong.")])
    for step in range(2):
        record_step([Group(task.task_id, [failed])], history, step)
    out = explorer.explore([task], loop, spec)
    assert [t.origin for t in out.groups[0]] == ["base", "base", "in_context", "in_context"]
    context = world_tokenizer.decode(out.groups[0].trajectories[2].turns[0].context_ids)
    assert "A previous attempt at this task failed" in context and "nine" in context and "Wrong." in context
    assert out.metrics["rollout/in_context_task_rate"] == 1.0
    assert out.metrics["rollout/in_context_episodes"] == 2.0
    assert out.metrics["rollout/in_context_tokens"] > 0 and out.metrics["rollout/in_context_unplayed"] == 0.0
    distilled = InContextReflectionExplorer(share=0.5, after_failures=2, distill=True).explore([task], loop, spec)
    assert [t.origin for t in distilled.groups[0]] == ["base", "base", "distilled", "distilled"]
    assert "previous attempt" not in world_tokenizer.decode(distilled.groups[0].trajectories[2].token_ids())


def test_in_context_episodes_generate_in_a_run(straight_run):
    """Every R³ step with in-context episodes generated tokens in them: none ended before its first token
    (the 2026-12-02 review found every one of them did, their prompt longer than the context)."""
    module, dm = make()
    trainer = quiet_trainer(4, deterministic=True, callbacks=[])
    logged = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("rollout/in_context")})

    trainer.callbacks.append(Watch())
    trainer.fit(module, dm)
    active = [row for row in logged if row["rollout/in_context_episodes"] > 0]
    assert active, "no step had in-context episodes"
    assert all(row["rollout/in_context_tokens"] > 0 and row["rollout/in_context_unplayed"] == 0 for row in active)


def test_a_context_too_short_for_the_in_context_prompt_is_refused_at_setup():
    module, dm = module_and_data(
        FewDigitTasks(),
        explorer=InContextReflectionExplorer(share=0.5, after_failures=1),
        agent=AgentLoopConfig(action_format="raw", max_context_tokens=100),
    )
    with pytest.raises(ValueError, match=r"data.explorer \(InContextReflectionExplorer\).*more than data.agent.max_context_tokens \(100\)"):
        quiet_trainer(1).fit(module, dm)
