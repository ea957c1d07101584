"""PhaseReport: validation success per phase and the RL-phase means of the retry figures."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from r3lightning.callbacks.phase_report import PhaseReport, SeedSpread, spread_text
from r3lightning.training.phases import PhaseSchedule, WarmStartPhase


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
    module = SimpleNamespace(phases=PhaseSchedule(WarmStartPhase(steps=10)))
    report.on_validation_end(_trainer(tmp_path, 10, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125}), module)
    for step, rate in ((11, 0.5), (12, 0.0), (13, 0.25)):
        # The step's own scalars come with its output (``callback_metrics`` keeps stale values).
        outputs = {"metrics": {"rollout/retry_improvement_rate": rate, "train/loss": 1.0}}
        report.on_train_batch_end(_trainer(tmp_path, step, {}), module, outputs, None, 0)
    report.on_validation_end(_trainer(tmp_path, 20, {"val/success_rate_greedy": 0.75, "val/success_rate": 0.5}), module)

    resumed = PhaseReport()
    resumed.load_state_dict(report.state_dict())
    resumed.on_fit_end(_trainer(tmp_path, 20, {}), module)

    summary = json.loads((tmp_path / "phase_report.json").read_text())
    assert summary["after_warmup"]["step"] == 10 and summary["after_warmup"]["phase"] == "warmstart"
    assert summary["final"]["val/success_rate_greedy"] == 0.75 and summary["final"]["phase"] == "rl"
    assert summary["rl_rollout_means"] == {"rollout/retry_improvement_rate": 0.25}
    printed = capsys.readouterr().out
    assert "after warm-start  step    10:  25.0% /  12.5%" in printed
    assert "after RL          step    20:  75.0% /  50.0%" in printed
    assert "rollout/retry_improvement_rate (mean over 3 RL steps): 25.0%" in printed


def _validate(report, tmp_path, step, metrics, module, tasks=4):
    trainer = _trainer(tmp_path, step, metrics)
    report.on_validation_epoch_start(trainer, module)
    report.on_validation_batch_end(trainer, module, None, SimpleNamespace(tasks=[None] * tasks), 0)
    report.on_validation_end(trainer, module)


def test_each_validation_is_written_as_json_and_markdown(tmp_path):
    report = PhaseReport()
    module = SimpleNamespace(phases=PhaseSchedule(WarmStartPhase(steps=0)))
    metrics = {
        "val/success_rate_greedy": 0.5, "val/success_rate": 0.25, "val/pass@1": 0.25, "val/pass@2": 0.5,
        "val/pass@4": 0.75, "val/mean@4": 0.25, "val/reward_mean": 0.3, "val/response_len_greedy": 6.0,
        "val/response_len": 7.25, "val/truncated_rate_greedy": 0.0, "val/truncated_rate": 0.125,
    }
    _validate(report, tmp_path, 40, metrics, module, tasks=4)
    written = json.loads((tmp_path / "validation_step40.json").read_text())
    assert (written["step"], written["phase"], written["tasks"]) == (40, "rl", 4)
    assert written["metrics"] == pytest.approx(metrics)
    table = (tmp_path / "validation_step40.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| suite"))
    assert "| greedy pass@1 | pass@1 | pass@2 | pass@4 | mean@4 | reward (sampled) |" in header
    row = table[table.index(header) + 2]
    assert row.startswith("| - | 50.0% | 25.0% | 50.0% | 75.0% | 25.0% | 0.300 | 6.0 / 7.2 | 0.0% / 12.5% |")


def test_fit_end_plots_progress_and_says_where_the_files_are(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report = PhaseReport()
    module = SimpleNamespace(phases=PhaseSchedule(WarmStartPhase(steps=2)))
    _validate(report, tmp_path, 2, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125}, module)
    for step, reward in ((3, 0.1), (4, 0.3)):
        report.on_train_batch_end(_trainer(tmp_path, step, {}), module, {"metrics": {"reward/mean": reward}}, None, 0)
    _validate(report, tmp_path, 4, {"val/success_rate_greedy": 0.5, "val/success_rate": 0.25, "val/pass@4": 0.75}, module)

    resumed = PhaseReport()
    resumed.load_state_dict(report.state_dict())
    resumed.last_validation_file = report.last_validation_file
    resumed.on_fit_end(_trainer(tmp_path, 4, {}), module)
    assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = json.loads((tmp_path / "phase_report.json").read_text())["reward_history"]
    assert [step for step, _ in history] == [3, 4] and [r for _, r in history] == pytest.approx([0.1, 0.3])
    printed = capsys.readouterr().out
    assert f"last validation: {tmp_path / 'validation_step4.json'} (and .md)" in printed
    assert f"summary: {tmp_path / 'phase_report.json'}" in printed
    assert f"progress plot: {tmp_path / 'progress.png'}" in printed


def test_without_matplotlib_the_plot_is_skipped_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure raises ImportError
    report = PhaseReport()
    module = SimpleNamespace(phases=PhaseSchedule(WarmStartPhase(steps=0)))
    _validate(report, tmp_path, 3, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125}, module)
    report.on_fit_end(_trainer(tmp_path, 3, {}), module)
    printed = capsys.readouterr().out
    assert "progress plot skipped: matplotlib is not installed (pip install matplotlib)" in printed
    assert not (tmp_path / "progress.png").exists() and (tmp_path / "phase_report.json").exists()


def test_a_recipes_seed_spread_is_printed_beside_the_runs_figures(tmp_path, capsys):
    """Hand-computed: [0.25, 0.5, 0.75] -> mean 50.0%, sample std 25.0, range 25.0-75.0."""
    spread = SeedSpread(after_warmup_greedy=[0.1, 0.2], after_rl_greedy=[0.25, 0.5, 0.75], source="docs/results.md")
    report = PhaseReport(seed_spread=spread)
    module = SimpleNamespace(phases=PhaseSchedule(WarmStartPhase(steps=10)))
    report.on_validation_end(_trainer(tmp_path, 10, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125}), module)
    report.on_validation_end(_trainer(tmp_path, 20, {"val/success_rate_greedy": 0.75, "val/success_rate": 0.5}), module)
    report.on_fit_end(_trainer(tmp_path, 20, {}), module)
    printed = capsys.readouterr().out
    assert "25.0% /  12.5%   (this recipe, greedy: 15.0% ± 7.1 over 2 runs (10.0-20.0))" in printed
    assert "75.0% /  50.0%   (this recipe, greedy: 50.0% ± 25.0 over 3 runs (25.0-75.0))" in printed
    assert "seed spread measured in docs/results.md" in printed
    assert spread_text([]) == ""


def test_the_summary_names_the_last_checkpoint(tmp_path, capsys):
    report = PhaseReport()
    module = SimpleNamespace(phases=PhaseSchedule(WarmStartPhase(steps=10)))
    report.on_validation_end(_trainer(tmp_path, 10, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125}), module)
    trainer = _trainer(tmp_path, 20, {})
    trainer.callbacks = [SimpleNamespace(), SimpleNamespace(last_model_path=str(tmp_path / "checkpoints" / "last.ckpt"))]
    report.on_fit_end(trainer, module)
    assert f"last checkpoint: {tmp_path / 'checkpoints' / 'last.ckpt'}" in capsys.readouterr().out


def test_a_whole_sanity_check_is_kept_as_the_model_before_training_and_logged_at_step_0(tmp_path, capsys):
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))
    module = SimpleNamespace(phases=PhaseSchedule())

    def sanity(num_sanity_val_steps, val_batches):
        trainer = _trainer(tmp_path, 0, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125})
        return SimpleNamespace(**{**vars(trainer), "sanity_checking": True, "num_sanity_val_steps": num_sanity_val_steps,
                                  "num_val_batches": val_batches, "logger": logger})

    partial = PhaseReport()
    partial.on_validation_end(sanity(2, [3]), module)  # 2 of 3 batches: not a validation of the model
    assert partial.records == [] and logged == []

    report = PhaseReport()
    report.on_validation_end(sanity(float("inf"), [3]), module)  # num_sanity_val_steps: -1
    assert report.records == [{"step": 0, "phase": "initial", "val/success_rate_greedy": 0.25, "val/success_rate": 0.125}]
    assert logged == [(0, {"val/success_rate_greedy": 0.25, "val/success_rate": 0.125})]
    report.on_validation_end(_trainer(tmp_path, 8, {"val/success_rate_greedy": 0.75, "val/success_rate": 0.5}), module)
    report.on_fit_end(_trainer(tmp_path, 8, {}), module)
    summary = json.loads((tmp_path / "phase_report.json").read_text())
    assert summary["before_training"]["step"] == 0 and summary["final"]["step"] == 8
    printed = capsys.readouterr().out
    assert "before training   step     0:  25.0% /  12.5%" in printed
    assert "after RL          step     8:  75.0% /  50.0%" in printed


class SampleExplorer:
    """Stands for the explorer class of that name: the spread compares class names."""


class ReflectRetryExplorer:
    pass


def _run_with(tmp_path, final_step, algorithm, explorer):
    module = SimpleNamespace(phases=PhaseSchedule(WarmStartPhase(steps=0)), algorithm=algorithm,
                             datamodule=SimpleNamespace(explorer=explorer))
    return module


def test_a_seed_spread_is_set_beside_only_the_recipe_it_measured(tmp_path, capsys):
    """A method stacked on a measured recipe, or a run of another length, is not shown the recipe's trained
    band as its own; the line says why."""
    spread = SeedSpread(after_rl_greedy=[0.5, 0.75], source="docs/results.md",
                        final_step=20, algorithm={"advantage": "grpo", "ranking": {"enabled": False}}, explorer="SampleExplorer")
    grpo = SimpleNamespace(advantage="grpo", ranking=SimpleNamespace(enabled=False))
    ranked = SimpleNamespace(advantage="grpo", ranking=SimpleNamespace(enabled=True))
    printed = {}
    for name, steps, algorithm, explorer in (("same", 20, grpo, SampleExplorer()), ("ranked", 20, ranked, SampleExplorer()),
                                              ("shorter", 8, grpo, ReflectRetryExplorer())):
        report = PhaseReport(seed_spread=spread)
        module = _run_with(tmp_path, steps, algorithm, explorer)
        folder = tmp_path / name
        report.on_validation_end(_trainer(folder, steps, {"val/success_rate_greedy": 0.75, "val/success_rate": 0.5}), module)
        report.on_fit_end(_trainer(folder, steps, {}), module)
        printed[name] = capsys.readouterr().out
    band = "(this recipe, greedy: 62.5% ± 17.7 over 2 runs (50.0-75.0))"
    assert band in printed["same"] and "not shown" not in printed["same"]
    for name in ("ranked", "shorter"):
        assert band not in printed[name] and "75.0% /  50.0%" in printed[name]
    assert ("the recipe's trained spread is not shown: this run is not the recipe it measured "
            "(model.algorithm.ranking.enabled is True, not False)") in printed["ranked"]
    assert "(ends at step 8, not 20; explorer ReflectRetryExplorer, not SampleExplorer)" in printed["shorter"]
