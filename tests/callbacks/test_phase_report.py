"""PhaseReport: validation success per phase and the RL-phase means of the retry figures."""

import json
from types import SimpleNamespace

import torch

from r3lightning.callbacks.phase_report import PhaseReport


def _trainer(tmp_path, step, metrics):
    return SimpleNamespace(
        global_step=step,
        sanity_checking=False,
        is_global_zero=True,
        callback_metrics={k: torch.tensor(v) for k, v in metrics.items()},
        loggers=[],
        default_root_dir=str(tmp_path),
    )


def test_summary_names_warmup_and_final_and_averages_rl_retry_figures(tmp_path, capsys):
    report = PhaseReport()
    module = SimpleNamespace(phases=SimpleNamespace(sft_warmup_steps=10))
    report.on_validation_end(_trainer(tmp_path, 10, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125}), module)
    for step, rate in ((11, 0.5), (12, 0.0), (13, 0.25)):
        trainer = _trainer(tmp_path, step, {"rollout/retry_improvement_rate": rate, "train/loss": 1.0})
        report.on_train_batch_end(trainer, module, None, None, 0)
    report.on_validation_end(_trainer(tmp_path, 20, {"val/success_rate_greedy": 0.75, "val/success_rate": 0.5}), module)

    resumed = PhaseReport()
    resumed.load_state_dict(report.state_dict())
    resumed.on_fit_end(_trainer(tmp_path, 20, {}), module)

    summary = json.loads((tmp_path / "phase_report.json").read_text())
    assert summary["after_warmup"]["step"] == 10 and summary["after_warmup"]["phase"] == "warmup"
    assert summary["final"]["val/success_rate_greedy"] == 0.75 and summary["final"]["phase"] == "rl"
    assert summary["rl_rollout_means"] == {"rollout/retry_improvement_rate": 0.25}
    printed = capsys.readouterr().out
    assert "after warm-start  step    10:  25.0% /  12.5%" in printed
    assert "after RL          step    20:  75.0% /  50.0%" in printed
    assert "rollout/retry_improvement_rate (mean over 3 RL steps): 25.0%" in printed
