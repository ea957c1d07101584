"""A recipe over seeds: its validation curve per seed, the gain's mean and spread, and what each run
spent (generated tokens, wall time), as one JSON and one plot.

Each seed runs ``r3l fit --config RECIPE [--config FRAGMENT ...] --seed_everything S`` (the sampling
seed follows it) into ``--runs/<name>/seed<S>`` unless that folder already holds a finished run
(``phase_report.json``), then reads the run's ``phase_report.json`` and TensorBoard scalars.

    python -m experiments.recipe_seeds --config configs/quickstart.yaml --seeds 0 1 2 \\
        --runs benchmarks/results/quickstart_smollm2/runs --out benchmarks/results/quickstart_smollm2/quickstart_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from scripts.machine_info import machine_info
from scripts.refactor_equivalence import read_scalars

GREEDY, SAMPLED = "val/success_rate_greedy", "val/success_rate"
SPENT = ("rollout/generated_tokens", "time/step_s", "time/rollout_s", "time/train_s")


def run_seed(configs: list[str], seed: int, folder: Path, extra: list[str]) -> None:
    if (folder / "phase_report.json").is_file():
        return
    command = [sys.executable, "-m", "r3lightning.cli.console", "fit"]
    for config in configs:
        command += ["--config", config]
    command += [
        "--seed_everything", str(seed),
        "--trainer.logger.init_args.save_dir", str(folder.parent.parent),
        "--trainer.logger.init_args.name", folder.parent.name,
        "--trainer.logger.init_args.version", folder.name,
        *extra,
    ]
    subprocess.run(command, check=True)


def seed_figures(folder: Path) -> dict:
    """The run's validation history, its gain (last minus first greedy validation) and its spending."""
    report = json.loads((folder / "phase_report.json").read_text())
    history = [{"step": r["step"], "phase": r["phase"], "greedy": r[GREEDY], "sampled": r[SAMPLED]} for r in report["history"]]
    scalars = read_scalars(str(folder), machine=True)
    spent = {tag: sum(value for _, value in scalars[tag]) for tag in SPENT if tag in scalars}
    steps = len(scalars.get("time/step_s", []))
    return {
        "history": history,
        "gain_greedy": history[-1]["greedy"] - history[0]["greedy"],
        "gain_sampled": history[-1]["sampled"] - history[0]["sampled"],
        "rl_steps": steps,
        "generated_tokens": spent.get("rollout/generated_tokens"),
        "step_seconds_total": spent.get("time/step_s"),
        "step_seconds_median": statistics.median(v for _, v in scalars["time/step_s"]) if steps else None,
        "rollout_seconds_total": spent.get("time/rollout_s"),
        "train_seconds_total": spent.get("time/train_s"),
    }


def mean_se(values: list[float]) -> dict:
    mean = statistics.mean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return {"mean": mean, "stderr": se, "per_seed": values, "seeds": len(values)}


def plot(per_seed: dict[str, dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.6), layout="constrained")
    axes = figure.subplots()
    for seed, figures in per_seed.items():
        steps = [h["step"] for h in figures["history"]]
        axes.plot(steps, [h["greedy"] for h in figures["history"]], marker="o", label=f"seed {seed}, greedy")
        axes.plot(steps, [h["sampled"] for h in figures["history"]], marker=".", linestyle="--", alpha=0.6, label=f"seed {seed}, sampled")
    axes.set_xlabel("RL step")
    axes.set_ylabel("validation success")
    axes.set_ylim(0, 1)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="recipe, then fragments, as r3l fit takes them")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", required=True, help="folder of the runs (<runs>/<name>/seed<S>)")
    parser.add_argument("--name", default="runs")
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    per_seed = {}
    for seed in args.seeds:
        folder = Path(args.runs) / args.name / f"seed{seed}"
        run_seed(args.config, seed, folder, extra)
        per_seed[str(seed)] = seed_figures(folder)
    figures = {
        "gain_greedy": mean_se([f["gain_greedy"] for f in per_seed.values()]),
        "gain_sampled": mean_se([f["gain_sampled"] for f in per_seed.values()]),
        "before_greedy": mean_se([f["history"][0]["greedy"] for f in per_seed.values()]),
        "after_greedy": mean_se([f["history"][-1]["greedy"] for f in per_seed.values()]),
        "before_sampled": mean_se([f["history"][0]["sampled"] for f in per_seed.values()]),
        "after_sampled": mean_se([f["history"][-1]["sampled"] for f in per_seed.values()]),
        "per_seed": per_seed,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "recipe_seeds",
        "figures": figures,
        "config": {"configs": args.config, "seeds": args.seeds, "extra_args": extra, "threads": os.environ.get("OMP_NUM_THREADS")},
        "machine": machine_info(),
    }
    out.write_text(json.dumps(report, indent=2))
    plot(per_seed, out.with_suffix(".png"), " + ".join(Path(c).name for c in args.config))
    g = figures["gain_greedy"]
    print(f"greedy gain {100 * g['mean']:+.1f} ± {100 * g['stderr']:.1f} points (SE over {len(args.seeds)} seeds); {out}")


if __name__ == "__main__":
    main()
