"""The LightningModule: on-policy rollouts, global token normalization, phases, learning signal."""


import lightning as L
import pytest
import torch
from harness import TINY_SPEC, LastStep, module_and_data, quiet_trainer, weights_changed

from r3lightning.training.models import build_tiny_model
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.training.optim import OptimConfig


def _fingerprint(model):
    return sum(float(p.detach().double().sum()) for p in model.parameters())


class WeightWatcher(L.Callback):
    """Fingerprints the weights after each optimizer step and at the start of each rollout."""

    def __init__(self):
        self.after_update, self.at_rollout = {}, {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.at_rollout[trainer.global_step] = self.fingerprint(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after_update[trainer.global_step] = self.fingerprint(module)
        assert all(t.model_version == trainer.global_step - 1 for t in outputs["trajectories"])

    @staticmethod
    def fingerprint(module):
        return _fingerprint(module.policy)


def test_rollout_k_uses_weights_after_update_k_minus_1():
    module, dm = module_and_data()
    watcher = WeightWatcher()
    quiet_trainer(4, callbacks=[watcher]).fit(module, dm)
    assert sorted(watcher.after_update) == [1, 2, 3, 4]
    for step in (1, 2, 3):
        # The batch rolled out at global step k was produced with the weights left by update k.
        assert watcher.at_rollout[step] == watcher.after_update[step]
    assert dm.cursor == 4


def test_parameters_change_and_metrics_logged():
    module, dm = module_and_data(sft_steps=1)
    t = quiet_trainer(3)
    t.fit(module, dm)
    assert all(weights_changed(module))
    metrics = t.callback_metrics
    for tag in ("train/loss_rl", "reward/mean", "train/entropy", "train/grad_norm", "time/rollout_s", "train/zero_variance_group_rate"):
        assert tag in metrics, tag
    assert module.skipped_steps == 0


def test_warm_start_does_not_depend_on_the_sampling_temperature():
    # The SFT head reads the untempered logits, so a recipe's temperature cannot perturb its warm-start
    # (dividing by 0.7 and multiplying back is not exact in floating point).
    weights = []
    for temperature in (1.0, 0.7):
        module, dm = module_and_data(sft_steps=2)
        dm.sampling.temperature = temperature
        quiet_trainer(2).fit(module, dm)
        weights.append([p.detach().clone() for p in module.policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def _gradients(module, experience):
    module.policy.zero_grad()
    totals = {
        "rl_tokens": float(experience.loss_mask[:, 1:].sum()),
        "rl_seqs": float((experience.loss_mask[:, 1:].sum(-1) > 0).sum()),
        "sft_tokens": float(experience.sft_mask[:, 1:].sum()),
        "sft_seqs": float((experience.sft_mask[:, 1:].sum(-1) > 0).sum()),
    }
    size = module.optim_config.micro_batch_size
    for start in range(0, len(experience), size):
        module.micro_batch_loss(experience.slice(start, start + size), totals)["loss"].backward()
    return torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gradient_independent_of_micro_batch_size(aggregation):
    module, dm = module_and_data(algorithm=AlgorithmConfig(policy_loss="ppo_clip", aggregation=aggregation))
    last = LastStep()
    quiet_trainer(1, callbacks=[last]).fit(module, dm)
    experience = last.output["experience"]
    experience.advantages = torch.randn_like(experience.advantages) * experience.loss_mask
    module.optim_config.micro_batch_size = len(experience)
    full = _gradients(module, experience)
    module.optim_config.micro_batch_size = 3
    split = _gradients(module, experience)
    torch.testing.assert_close(full, split, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sft_aggregation", ["token_mean", "seq_mean_token_mean"])
def test_sft_aggregation_value_and_micro_batch_independence(sft_aggregation):
    module, dm = module_and_data(sft_steps=1, algorithm=AlgorithmConfig(sft_aggregation=sft_aggregation, sft_weight=1.0))
    last = LastStep()
    quiet_trainer(1, callbacks=[last]).fit(module, dm)
    experience = last.output["experience"]  # demonstrations: SFT tokens only
    module.optim_config.micro_batch_size = len(experience)
    full = _gradients(module, experience)
    module.optim_config.micro_batch_size = 3
    torch.testing.assert_close(full, _gradients(module, experience), rtol=1e-4, atol=1e-6)

    with torch.no_grad():
        logits = module.policy(input_ids=experience.input_ids, attention_mask=experience.attention_mask).logits[:, :-1]
        nll = -torch.log_softmax(logits.float(), -1).gather(-1, experience.input_ids[:, 1:, None])[..., 0]
        mask = experience.sft_mask[:, 1:].float()
        expected = (nll * mask).sum() / mask.sum() if sft_aggregation == "token_mean" else (
            ((nll * mask).sum(-1) / mask.sum(-1)).mean()
        )
        totals = {"rl_tokens": 0.0, "rl_seqs": 0.0, "sft_tokens": float(mask.sum()), "sft_seqs": float(len(mask))}
        got = module.micro_batch_loss(experience, totals)["loss_sft"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_sft_phase_then_rl_phase_and_phase_in_checkpoint(tmp_path):
    module, dm = module_and_data(sft_steps=2)
    phases = []

    class PhaseSpy(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            phases.append((outputs["trajectories"][0].origin, trainer.callback_metrics["train/phase_rl"].item()))

    t = quiet_trainer(4, callbacks=[PhaseSpy()])
    t.fit(module, dm)
    assert [p[0] for p in phases] == ["demo", "demo", "base", "base"]
    path = tmp_path / "last.ckpt"
    t.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["r3lightning"]["phase"] == "rl"
    assert saved["r3lightning"]["weight_version"] == 3
    assert saved["RolloutDataModule"]["cursor"] == 4


def test_scheduled_learning_rate_warm_up_then_phase_rates():
    from r3lightning.training.optim import scheduled_learning_rate
    from r3lightning.training.phases import PhaseSchedule, WarmStartPhase

    optim = OptimConfig(lr=0.1, warmup_steps=1)
    phases = PhaseSchedule(WarmStartPhase(steps=3, lr=1.0))
    # Linear warm-up halves each phase's first step; the warm-start's rate holds until its last
    # step (2), then RL warms up again from step 3.
    rates = [scheduled_learning_rate(step, optim, phases.at(step)) for step in range(5)]
    assert rates == pytest.approx([0.5, 1.0, 1.0, 0.05, 0.1])
    no_rate = PhaseSchedule(WarmStartPhase(steps=2))
    assert scheduled_learning_rate(0, OptimConfig(lr=0.3), no_rate.at(0)) == pytest.approx(0.3)


def test_scheduled_learning_rate_cosine_decays_each_phase():
    from r3lightning.training.optim import scheduled_learning_rate
    from r3lightning.training.phases import PhaseSchedule, WarmStartPhase

    optim = OptimConfig(lr=1.0, warmup_steps=1, lr_decay="cosine", min_lr_ratio=0.1)
    phases = PhaseSchedule(WarmStartPhase(steps=3, lr=2.0))
    # SFT steps 0-2: warm-up, then cos over (3 - 1) steps: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55 at step 2.
    # RL steps 3-6 (total 7): warm-up, then cos over 3 steps: progress 0, 1/3, 2/3.
    rates = [scheduled_learning_rate(step, optim, phases.at(step), total_steps=7) for step in range(7)]
    assert rates == pytest.approx([1.0, 2.0, 1.1, 0.5, 1.0, 0.775, 0.325])
    with pytest.raises(ValueError, match="trainer.max_steps"):
        scheduled_learning_rate(3, optim, phases.at(3), total_steps=None)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        OptimConfig(min_lr_ratio=1.5)


@pytest.mark.parametrize("reset", [True, False])
def test_optimizer_state_reset_when_rl_starts(reset):
    module, dm = module_and_data(sft_steps=2)
    module.phases.rl.reset_optimizer = reset
    adam_steps = []

    class AdamStepSpy(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            state = module.optimizers().optimizer.state[next(module.policy.parameters())]
            adam_steps.append(int(state["step"]))

    quiet_trainer(4, callbacks=[AdamStepSpy()]).fit(module, dm)
    # AdamW counts its own steps: a reset restarts the count (and the moments) at the first RL step.
    assert adam_steps == ([1, 2, 1, 2] if reset else [1, 2, 3, 4])


def test_validations_during_sft_skipped_without_changing_training():
    from r3lightning.callbacks.phase_report import PhaseReport

    runs = {}
    for validate_during_sft in (True, False):
        module, dm = module_and_data(sft_steps=2)
        module.phases.warmstart.validate = validate_during_sft
        report = PhaseReport()
        quiet_trainer(
            3, val_check_interval=1, check_val_every_n_epoch=None, limit_val_batches=1, callbacks=[report]
        ).fit(module, dm)
        runs[validate_during_sft] = ([r["step"] for r in report.records], WeightWatcher.fingerprint(module))
    assert runs[True][0] == [1, 2, 3]
    # The first validation kept is the one at the step RL begins: the finished warm-start.
    assert runs[False][0] == [2, 3]
    assert runs[False][1] == runs[True][1]


def test_logratio_per_origin_is_zero_for_fresh_samples():
    """train/logratio_<origin>: the trainer's log-probs of freshly sampled tokens, before the update,
    equal the engine's, so the gap it reports for distilled rows is the context's, not numerics'."""
    module, dm = module_and_data(algorithm=AlgorithmConfig(policy_loss="pg"))
    last = LastStep()
    t = quiet_trainer(1, callbacks=[last])
    t.fit(module, dm)
    assert set(last.output["experience"].origins) == {"base"}
    assert abs(float(t.callback_metrics["train/logratio_base"])) < 1e-4
    assert not any(tag.startswith("train/logratio_") and tag != "train/logratio_base" for tag in t.callback_metrics)


def test_kl_reference_is_the_warm_started_policy():
    """With an SFT warm-start, the KL anchors to the policy the warm-start produced (the RLHF
    convention), not to the weights before it: the reference is snapshotted at the first RL step."""
    module, dm = module_and_data(sft_steps=1, algorithm=AlgorithmConfig(policy_loss="pg", kl_coef=0.1))
    watcher = WeightWatcher()
    quiet_trainer(2, callbacks=[watcher]).fit(module, dm)
    untrained = build_tiny_model(TINY_SPEC, module.tokenizer, seed=0)
    assert _fingerprint(module.reference) == watcher.after_update[1] != _fingerprint(untrained)
    # A copy, not the policy itself: later updates must leave it where it is.
    assert all(r.data_ptr() != p.data_ptr() for r, p in zip(module.reference.parameters(), module.policy.parameters()))


def test_kl_run_resumes_from_a_warm_start_without_reference(tmp_path):
    """A warm-start checkpoint trained without KL resumes into an RL run with KL (its reference is
    taken at the first RL step); past the warm-start, a checkpoint without reference is refused."""
    module, dm = module_and_data(sft_steps=1)
    first = quiet_trainer(1)
    first.fit(module, dm)
    warm_start = tmp_path / "warm.ckpt"
    first.save_checkpoint(warm_start)
    after_sft = _fingerprint(module.policy)
    resumed, dm = module_and_data(sft_steps=1, algorithm=AlgorithmConfig(policy_loss="pg", kl_coef=0.1))
    quiet_trainer(2).fit(resumed, dm, ckpt_path=warm_start)
    assert _fingerprint(resumed.reference) == pytest.approx(after_sft, abs=0.0)

    rl_checkpoint = tmp_path / "rl.ckpt"
    second = quiet_trainer(2)
    module, dm = module_and_data(sft_steps=1)
    second.fit(module, dm)
    second.save_checkpoint(rl_checkpoint)
    refused, dm = module_and_data(sft_steps=1, algorithm=AlgorithmConfig(policy_loss="pg", kl_coef=0.1))
    with pytest.raises(ValueError, match="no reference model.*past the warm-start"):
        quiet_trainer(3).fit(refused, dm, ckpt_path=rl_checkpoint)
