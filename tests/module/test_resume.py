"""Exact resume: 2N steps in one run == N steps + checkpoint + resume + N steps."""

from dataclasses import replace
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from digit_suite import DigitSuite
from harness import TINY_SPEC, module_and_data, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from r3lightning.callbacks.health import HealthWatchdog
from r3lightning.callbacks.monitor import TrainingDynamicsMonitor
from r3lightning.training.models import ModelConfig
from r3lightning.algos.objective import AlgorithmConfig

N = 2


def make(spec=TINY_SPEC):
    return module_and_data(
        DigitSuite(),
        seed=3,
        model=ModelConfig(tiny=spec),
        # Ratio, clipping and a KL to the reference: optimizer moments, the reference and the
        # behaviour log-probs all have to come back for the runs to agree.
        algorithm=AlgorithmConfig(policy_loss="ppo_clip", kl_coef=0.05, recompute_old_logprobs=True),
        lr=3e-3,
        micro_batch_size=4,
        warmup_steps=3,
        sft_steps=1,
    )


class RewardLog(L.Callback):
    """Per optimizer step: the logged reward/mean (RL steps) and the task ids trained on."""

    def __init__(self):
        self.rows = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        rl_step = outputs["trajectories"][0].origin != "demo"
        reward = float(trainer.callback_metrics["reward/mean"]) if rl_step else None
        self.rows[trainer.global_step] = (reward, [t.task_id for t in batch.tasks])


def fit(module, dm, steps, ckpt_path=None, callbacks=()):
    log = RewardLog()
    trainer = quiet_trainer(
        steps, enable_checkpointing=bool(callbacks), deterministic=True,
        callbacks=[log, HealthWatchdog(), TrainingDynamicsMonitor(), *callbacks],
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer, log.rows


def params(module):
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """2N steps in one run; a checkpoint is saved after step N on the way, as ModelCheckpoint does."""
    root = tmp_path_factory.mktemp("resume")
    L.seed_everything(0)
    module, dm = make()
    saver = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=N, save_top_k=-1)
    _, rows = fit(module, dm, 2 * N, callbacks=[saver])
    return SimpleNamespace(module=module, dm=dm, rows=rows, checkpoint=str(root / f"step={N}.ckpt"))


def test_two_n_steps_equal_n_plus_resume_plus_n(straight_run):
    # A fresh process would start from another global RNG state: resume must not depend on it.
    L.seed_everything(1234)
    resumed, resumed_dm = make()
    _, resumed_rows = fit(resumed, resumed_dm, 2 * N, ckpt_path=straight_run.checkpoint)

    assert sorted(resumed_rows) == list(range(N + 1, 2 * N + 1))
    # Same tasks and the same logged rewards at every resumed step.
    assert resumed_rows == {k: v for k, v in straight_run.rows.items() if k > N}
    rewards = [reward for reward, _ in straight_run.rows.values() if reward is not None]
    assert len(rewards) == 2 * N - 1 and len(set(rewards)) > 1 and 0 < sum(rewards)
    assert resumed_dm.cursor == straight_run.dm.cursor == 2 * N
    assert resumed.engine.weight_version == straight_run.module.engine.weight_version
    a, b = params(straight_run.module), params(resumed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    saved = torch.load(straight_run.checkpoint, weights_only=False)["state_dict"]
    assert any(not torch.equal(saved[f"policy.{k}"], v) for k, v in a.items())  # the second half trained


@pytest.mark.parametrize(
    "spec, message",
    [
        (replace(TINY_SPEC, hidden_size=96, num_attention_heads=3), "model does not match"),
        (replace(TINY_SPEC, vocab_size=280), "tokenizer differs"),  # fewer tokens than the digit texts fill
    ],
    ids=["other-width", "other-vocab"],
)
def test_resume_with_changed_model_fails_clearly(straight_run, spec, message):
    other, other_dm = make(spec)
    with pytest.raises(ValueError, match=message):
        fit(other, other_dm, 2 * N, ckpt_path=straight_run.checkpoint)
