"""experiments/warmstart_length.py: how long a warm-start runs before its policy acts, per seed and share."""

from __future__ import annotations

import json
import sys

from harness import ROOT

from experiments import warmstart_length as length


def test_first_step_at_a_level_is_the_first_validation_reaching_it():
    curve = [(40, 0.0), (80, 0.3), (120, 0.5), (160, 0.4), (200, 0.9)]
    assert length.first_step_at(curve, 0.5) == 120
    assert length.first_step_at(curve, 0.95) is None
    assert length.first_step_at([], 0.5) is None


def test_summary_gives_mean_spread_and_the_seeds_whose_judgments_fired():
    runs = {
        "share0.0_seed0": {"greedy_at_end": 0.5, "success_judgment_samples_per_rl_step": [0.0, 0.0]},
        "share0.0_seed1": {"greedy_at_end": 0.7, "success_judgment_samples_per_rl_step": [0.0, 0.0]},
        "share0.25_seed0": {"greedy_at_end": 0.2, "success_judgment_samples_per_rl_step": [0.0, 3.0]},
        "share0.25_seed1": {"greedy_at_end": 0.4, "success_judgment_samples_per_rl_step": [0.0, 0.0]},
    }
    figures = length.summary(runs, [0.0, 0.25], [0, 1])
    assert figures["share0.0/greedy_at_end_mean"] == 0.6
    assert abs(figures["share0.0/greedy_at_end_sd"] - 0.1414) < 1e-4
    assert figures["share0.0/seeds_whose_judgments_fired"] == []
    assert figures["share0.25/seeds_whose_judgments_fired"] == [0]


def test_a_run_validates_its_warm_start_and_counts_success_judgments(tmp_path, monkeypatch):
    """End to end on the difficulty-2 recipe made tiny: the curve holds the warm-start's validations
    only, its last at the warm-start's end, and the RL steps' success-judgment counts are read back."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "length.json"
    monkeypatch.setattr(sys, "argv", [
        "warmstart_length", "--out", str(out), "--log_dir", str(tmp_path / "runs"), "--shares", "0.25", "--seeds", "0",
        "--warmup_steps", "4", "--rl_steps", "1", "--val_every", "2", "--cores", "1", "--override",
        "data.suite.init_args.num_val_tasks=2", "data.tasks_per_step=2", "data.group_size=2",
        "data.demos.tasks_per_step=2", "data.demos.reflection_tasks_per_step=2",
    ])
    length.main()
    record = json.loads(out.read_text())
    run = record["per_run"]["share0.25_seed0"]
    assert [step for step, _ in run["curve_greedy"]] == [2, 4]
    assert run["greedy_at_end"] == run["curve_greedy"][-1][1]
    assert len(run["success_judgment_samples_per_rl_step"]) == 1
    assert set(record) == {"benchmark", "figures", "per_run", "config", "machine"}
    assert record["config"]["shares"] == [0.25]
