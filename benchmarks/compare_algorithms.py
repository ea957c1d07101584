"""GRPO vs R³L and its ablations at equal rollout budget on the procedural text world.

Every run starts from the same recipe (configs/quickstart.yaml: tiny policy, SFT warm-start on the
scripted expert and diagnostician, then RL) and differs only in the algorithm fragment. Each method
gets ``group_size`` episodes per task per step (R³L: half base, half retries), so the rollout budget
is equal. Validation success (greedy) is recorded at every validation; the JSON holds per-seed
curves and the final means, and a PNG plots mean validation success vs step.

    python benchmarks/compare_algorithms.py --out benchmarks/results/compare_algorithms.json --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

METHODS = {
    "grpo": "configs/algorithms/grpo.yaml",
    "r3l": "configs/algorithms/r3l.yaml",
    "r3l_wo_reflect": "configs/algorithms/r3l_wo_reflect.yaml",
    "r3l_wo_credit": "configs/algorithms/r3l_wo_credit.yaml",
    "r3l_wo_positive": "configs/algorithms/r3l_wo_positive.yaml",
}


def run_one(method: str, seed: int, args: argparse.Namespace, log_dir: str) -> dict:
    from callbacks.phase_report import PhaseReport
    from r3lightning.cli import R3LightningCLI

    overrides = [
        "fit",
        "--config", args.recipe,
        "--config", METHODS[method],
        "--seed_everything", str(seed),
        "--data.seed", str(seed),
        "--trainer.max_steps", str(args.warmup_steps + args.rl_steps),
        "--model.phases.sft_warmup_steps", str(args.warmup_steps),
        "--trainer.val_check_interval", str(args.val_every),
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", log_dir,
        "--trainer.logger.init_args.name", f"{method}_seed{seed}",
    ]
    if method == "grpo":
        # Same RL objective family as R³L (pg, no ratio) so the comparison isolates the method.
        overrides += ["--model.algorithm.policy_loss", "pg"]
    start = time.perf_counter()
    cli = R3LightningCLI(args=overrides)
    report = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PhaseReport))
    curve = [(r["step"], r.get("val/success_rate_greedy", float("nan"))) for r in report.records]
    return {"curve": curve, "final": curve[-1][1] if curve else float("nan"), "wall_s": time.perf_counter() - start}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, runs in results.items():
        steps = [s for s, _ in next(iter(runs.values()))["curve"]]
        means = [statistics.mean(run["curve"][i][1] for run in runs.values()) for i in range(len(steps))]
        ax.plot(steps, means, marker="o", label=method)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation success (greedy)")
    ax.set_title("Procedural text world: mean over seeds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON result path (the PNG goes beside it)")
    parser.add_argument("--recipe", default="configs/quickstart.yaml")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--warmup_steps", type=int, default=40)
    parser.add_argument("--rl_steps", type=int, default=40)
    parser.add_argument("--val_every", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "compare_runs")
    results: dict[str, dict[str, dict]] = {}
    for method in args.methods:
        results[method] = {str(seed): run_one(method, seed, args, log_dir) for seed in args.seeds}
    figures = {}
    for method, runs in results.items():
        finals = [run["final"] for run in runs.values()]
        figures[f"{method}_final_val_success_mean"] = statistics.mean(finals)
        figures[f"{method}_final_val_success_min"] = min(finals)
        figures[f"{method}_wall_s_mean"] = statistics.mean(run["wall_s"] for run in runs.values())
    record = {
        "benchmark": "compare_algorithms",
        "figures": figures,
        "per_seed": results,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=2)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
