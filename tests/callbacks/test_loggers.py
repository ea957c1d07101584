"""The loggers users have: TensorBoard, CSV and W&B (offline, no network) on one run, each with the
per-step figures (advantage statistics, response-length spread, peak memory) and the rollout samples
through the logger (TensorBoard text, a W&B table); the figures' functions against hand-computed values."""

import csv
import json

import pytest
import torch
from digit_suite import DigitSuite
from harness import module_and_data, quiet_trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from r3lightning.callbacks.monitor import (
    SAMPLE_COLUMNS,
    RolloutSampleLogger,
    TrainingDynamicsMonitor,
    advantage_stats,
    length_spread,
    peak_memory_gb,
)

NEW_TAGS = (
    "train/advantage_mean", "train/advantage_std", "train/advantage_min", "train/advantage_max",
    "train/advantage_zero_share", "rollout/response_len_std", "rollout/response_len_min",
    "rollout/response_len_max", "memory/peak_rss_gb",
)


def test_advantage_stats_over_loss_tokens():
    advantages = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    loss_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    # Loss tokens: 1, 1, -0.5, 0, 0 -> mean 0.3, population variance (0.49*2 + 0.64 + 0.09*2) / 5 = 0.36.
    stats = advantage_stats(advantages, loss_mask)
    assert stats["train/advantage_mean"] == pytest.approx(0.3)
    assert stats["train/advantage_std"] == pytest.approx(0.6)
    assert (stats["train/advantage_min"], stats["train/advantage_max"]) == (-0.5, 1.0)
    assert stats["train/advantage_zero_share"] == pytest.approx(1 / 3)  # row 2 of the 3 rows with loss tokens
    assert advantage_stats(advantages, torch.zeros_like(loss_mask)) == {}


def test_length_spread_and_peak_memory():
    spread = length_spread([2, 4, 4, 4, 5, 5, 7, 9])
    assert spread == {"rollout/response_len_std": 2.0, "rollout/response_len_min": 2.0, "rollout/response_len_max": 9.0}
    assert length_spread([]) == {}
    memory = peak_memory_gb(torch.device("cpu"))
    assert set(memory) == {"memory/peak_rss_gb"} and 0.01 < memory["memory/peak_rss_gb"] < 1024


def test_tensorboard_csv_and_wandb_offline_get_the_figures_and_the_samples(tmp_path, monkeypatch):
    wandb_loggers = pytest.importorskip("lightning.pytorch.loggers.wandb")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    module, dm = module_and_data(DigitSuite(), group_size=2)
    loggers = [
        TensorBoardLogger(str(tmp_path), name="tb"),
        CSVLogger(str(tmp_path), name="csv"),
        wandb_loggers.WandbLogger(project="r3l-test", save_dir=str(tmp_path), offline=True),
    ]
    trainer = quiet_trainer(2, logger=loggers, log_every_n_steps=1,
                            callbacks=[TrainingDynamicsMonitor(), RolloutSampleLogger(every_n_steps=1, num_samples=2)])
    trainer.fit(module, dm)
    wandb_summary = set(loggers[2].experiment.summary.keys())
    loggers[2].experiment.finish()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(loggers[0].log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert set(NEW_TAGS) <= set(events.Tags()["scalars"])
    assert any(t.startswith("samples/rollouts") for t in events.Tags()["tensors"])

    with open(f"{loggers[1].log_dir}/metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert set(NEW_TAGS) <= set(rows[0])
    assert len([r for r in rows if r["train/advantage_std"]]) == 2

    run_dir = next(tmp_path.glob("wandb/offline-run-*"))
    tables = sorted(run_dir.glob("files/media/table/samples/rollouts_*.table.json"))
    assert len(tables) == 2  # one per step
    table = json.loads(tables[0].read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS) and len(table["data"]) == 2
    assert "Say a number" in table["data"][0][-1]
    assert set(NEW_TAGS) <= wandb_summary
