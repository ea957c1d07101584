"""HealthWatchdog: non-finite steps are skipped and counted; too many stop the run with a checkpoint."""

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from harness import module_and_data, quiet_trainer

from r3lightning.callbacks.health import BAD_STEPS_CHECKPOINT, EXCEPTION_CHECKPOINT, HealthWatchdog


def poison(module, dm, bad_batches):
    """Make the micro-batch loss NaN while the datamodule's batch (its step index) is in ``bad_batches``."""
    original = module.micro_batch_loss

    def micro_batch_loss(micro, totals):
        out = original(micro, totals)
        if dm.cursor - 1 in bad_batches:
            out["loss"] = out["loss"] * float("nan")
        return out

    module.micro_batch_loss = micro_batch_loss


class Recorder(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.rows.append((batch.step, trainer.global_step, float(metrics["train/skipped_steps"]), float(metrics["health/consecutive_bad_steps"])))


def test_non_finite_steps_are_skipped_counted_and_training_continues(tmp_path, capsys):
    module, dm = module_and_data(max_bad_steps=3)
    poison(module, dm, {1, 2})
    recorder = Recorder()
    t = quiet_trainer(4, default_root_dir=str(tmp_path), callbacks=[HealthWatchdog(), recorder])
    t.fit(module, dm)
    # Six batches for four optimizer steps: the two poisoned ones changed nothing and were counted.
    assert t.global_step == 4 and dm.cursor == 6
    assert module.skipped_steps == 2 and module.consecutive_bad_steps == 0
    assert [r[2] for r in recorder.rows] == [0, 1, 2, 2, 2, 2]
    assert [r[3] for r in recorder.rows] == [0, 1, 2, 0, 0, 0]
    assert [r[1] for r in recorder.rows] == [1, 1, 1, 2, 3, 4]
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())
    assert not (tmp_path / "checkpoints" / BAD_STEPS_CHECKPOINT).exists()
    assert "stopped" not in capsys.readouterr().out


def test_too_many_bad_steps_stop_with_checkpoint_and_message(tmp_path, capsys):
    module, dm = module_and_data(max_bad_steps=3)
    poison(module, dm, set(range(1, 100)))
    good = {}

    class Snapshot(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch.step == 0:
                good.update({k: v.clone() for k, v in module.policy.state_dict().items()})

    t = quiet_trainer(20, default_root_dir=str(tmp_path), callbacks=[Snapshot(), HealthWatchdog()])
    t.fit(module, dm)
    assert t.global_step == 1 and dm.cursor == 4 and module.skipped_steps == 3
    path = tmp_path / "checkpoints" / BAD_STEPS_CHECKPOINT
    assert path.is_file()
    out = capsys.readouterr().out
    assert "3 consecutive steps with non-finite loss or gradients" in out
    assert str(path) in out and "--ckpt_path" in out
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 1 and saved["r3lightning"]["skipped_steps"] == 3
    assert saved["RolloutDataModule"]["cursor"] == 4
    # The checkpoint holds the last good weights: the bad steps did not touch them.
    for name, value in good.items():
        torch.testing.assert_close(saved["state_dict"][f"policy.{name}"], value, rtol=0, atol=0)


def test_exception_mid_training_saves_what_was_trained(tmp_path, capsys):
    module, dm = module_and_data()
    original = module.micro_batch_loss

    def crash_on_third_batch(micro, totals):
        if dm.cursor - 1 == 2:
            raise RuntimeError("simulated crash")
        return original(micro, totals)

    module.micro_batch_loss = crash_on_third_batch
    with pytest.raises(RuntimeError, match="simulated crash"):
        quiet_trainer(5, default_root_dir=str(tmp_path), callbacks=[HealthWatchdog()]).fit(module, dm)
    path = tmp_path / "checkpoints" / EXCEPTION_CHECKPOINT
    assert torch.load(path, weights_only=False)["global_step"] == 2
    assert f"saved in {path}" in capsys.readouterr().out


def test_dynamics_warnings_print_once_and_log_flags(tmp_path, capsys):
    module, dm = module_and_data()
    watchdog = HealthWatchdog(window=1, entropy_min=100.0, entropy_max=0.0, length_growth_factor=0.0, zero_variance_max=-1.0)
    flags = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            flags.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("health/")})

    t = quiet_trainer(3, default_root_dir=str(tmp_path), callbacks=[watchdog, Spy()])
    t.fit(module, dm)
    out = capsys.readouterr().out
    for kind in ("entropy_collapse", "entropy_explosion", "response_len_growth", "zero_variance_groups"):
        assert out.count(f"health warning ({kind})") == 1, kind
    last = flags[-1]
    assert last["health/entropy_collapse"] == 1.0 and last["health/entropy_explosion"] == 1.0
    assert last["health/zero_variance_groups"] == 1.0 and last["health/warnings"] == 4.0
    assert math.isfinite(last["health/response_len_growth"])
    assert watchdog.state_dict()["warned"] == sorted(["entropy_collapse", "entropy_explosion", "response_len_growth", "zero_variance_groups"])


def feed(watchdog, rows, vocab=1000):
    fake_module = SimpleNamespace(tokenizer=[0] * vocab)
    out = []
    for row in rows:
        out.append(watchdog._check_dynamics(SimpleNamespace(callback_metrics={"train/phase_rl": 1.0, **row}), fake_module))
    return out


def test_length_blow_up_compares_consecutive_windows(capsys):
    watchdog = HealthWatchdog(window=3, length_growth_factor=2.0)
    steady = feed(watchdog, [{"rollout/response_len": 10.0}] * 6)
    assert steady[-1]["health/response_len_growth"] == pytest.approx(1.0)
    assert "health/response_len_growth" not in steady[4]  # needs two full windows
    grown = feed(watchdog, [{"rollout/response_len": 25.0}] * 3)
    assert grown[-1]["health/response_len_growth"] == pytest.approx(2.5)
    assert capsys.readouterr().out.count("response_len_growth") == 1


def test_entropy_and_zero_variance_thresholds(capsys):
    watchdog = HealthWatchdog(window=2, entropy_min=0.05, zero_variance_max=0.8)
    healthy = feed(watchdog, [{"train/entropy": 1.0, "train/zero_variance_group_rate": 0.5}] * 2)
    assert healthy[-1]["health/entropy_collapse"] == 0.0 and healthy[-1]["health/entropy_explosion"] == 0.0
    assert healthy[-1]["health/zero_variance_groups"] == 0.0
    assert capsys.readouterr().out == ""
    # Default explosion threshold: 0.9 ln(V) nats.
    high = feed(watchdog, [{"train/entropy": 0.95 * math.log(1000), "train/zero_variance_group_rate": 0.9}] * 2)
    assert high[-1]["health/entropy_explosion"] == 1.0 and high[-1]["health/zero_variance_groups"] == 1.0
    low = feed(watchdog, [{"train/entropy": 0.01, "train/zero_variance_group_rate": 0.9}] * 3)
    assert low[-1]["health/entropy_collapse"] == 1.0
    out = capsys.readouterr().out
    assert out.count("entropy_explosion") == 1 and out.count("entropy_collapse") == 1 and out.count("zero_variance_groups") == 1
    # SFT-phase steps are not judged.
    assert feed(watchdog, [{"train/phase_rl": 0.0, "train/entropy": 0.0}]) == [{}]
