"""How long a recipe's SFT warm-start must run before its policy is past the climb, per warm-start seed,
and whether the success judgments it teaches fire once RL starts.

Each (success share, seed) run trains the recipe's warm-start for ``--warmup_steps``, validating every
``--val_every`` steps, then runs ``--rl_steps`` RL steps under ``--preset`` (default ``r3l``, whose
success judgments are on) to count ``rollout/success_judgment_samples``. Runs are spread over the cores
one torch thread each (``experiments/schedule.py``); a run's figures depend on its thread count only.

    python -m experiments.warmstart_length --recipe configs/examples/r3l_procedural_d2_cpu.yaml \
        --shares 0 0.25 --seeds 0 1 2 3 4 --warmup_steps 480 --out benchmarks/results/warmstart_length_d2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Optional

from benchmarks.machine_info import machine_info
from experiments.compare_algorithms import key_value_args
from experiments.schedule import Job, available_cores, run_jobs

ROOT = Path(__file__).resolve().parents[1]


def overrides(args: argparse.Namespace, share: float, seed: int, log_dir: str) -> list[str]:
    """The CLI arguments of one run: the recipe, then the preset, then this run's share and seed."""
    return [
        "--config", args.recipe,
        "--config", f"configs/algorithms/{args.preset}.yaml",
        "--seed_everything", str(seed),
        "--data.seed", str(seed),
        "--data.demos.success_reflection_share", str(share),
        "--trainer.max_steps", str(args.warmup_steps + args.rl_steps),
        "--model.phases.sft_warmup_steps", str(args.warmup_steps),
        "--model.phases.validate_during_sft", "true",
        "--trainer.val_check_interval", str(args.val_every),
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", log_dir,
        "--trainer.logger.init_args.name", f"share{share}_seed{seed}",
        *[arg for override in args.override for arg in key_value_args(override)],
    ]


def first_step_at(curve: list[tuple[int, float]], level: float) -> Optional[int]:
    """The first validated step whose success is at least ``level`` (None: never)."""
    return next((step for step, value in curve if value >= level), None)


def one_run(args: argparse.Namespace, share: float, seed: int, log_dir: str) -> dict:
    """Train one warm-start and its RL steps; its validation curve and success-judgment samples."""
    from benchmarks.recipe_run import scalars
    from r3lightning.callbacks.phase_report import PhaseReport
    from r3lightning.cli.main import R3LightningCLI

    start = time.perf_counter()
    cli = R3LightningCLI(args=["fit", *overrides(args, share, seed, log_dir)])
    # The phase report's records carry the trained step of each validation (the event files log it one lower).
    records = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PhaseReport)).records
    warm = [record for record in records if record["step"] <= args.warmup_steps]
    greedy = [(record["step"], record["val/success_rate_greedy"]) for record in warm]
    sampled = [(record["step"], record["val/success_rate"]) for record in warm]
    series = scalars(cli.trainer.logger.log_dir)
    judgments = [value for _, value in series.get("rollout/success_judgment_samples", [])]
    return {
        "curve_greedy": greedy,
        "curve_sampled": sampled,
        "first_step_greedy_at_least_0.5": first_step_at(greedy, 0.5),
        "greedy_at_end": greedy[-1][1] if greedy else None,
        "success_judgment_samples_per_rl_step": judgments,
        "rl_success_rate_per_step": [value for _, value in series.get("reward/success_rate", [])],
        "wall_s": round(time.perf_counter() - start, 1),
    }


def summary(runs: dict[str, dict], shares: list[float], seeds: list[int]) -> dict:
    """Per share: the end-of-warm-start greedy success's mean and spread over seeds, and the runs whose
    success judgments fired in RL."""
    figures = {}
    for share in shares:
        ends = [runs[f"share{share}_seed{seed}"]["greedy_at_end"] for seed in seeds]
        fired = [seed for seed in seeds if sum(runs[f"share{share}_seed{seed}"]["success_judgment_samples_per_rl_step"]) > 0]
        figures[f"share{share}/greedy_at_end_mean"] = round(statistics.mean(ends), 4)
        figures[f"share{share}/greedy_at_end_sd"] = round(statistics.stdev(ends), 4) if len(ends) > 1 else 0.0
        figures[f"share{share}/seeds_whose_judgments_fired"] = fired
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="configs/examples/r3l_procedural_d2_cpu.yaml")
    parser.add_argument("--preset", default="r3l", help="configs/algorithms/<preset>.yaml for the RL steps")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25], help="data.demos.success_reflection_share values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup_steps", type=int, default=480)
    parser.add_argument("--rl_steps", type=int, default=3)
    parser.add_argument("--val_every", type=int, default=40)
    parser.add_argument("--override", nargs="*", default=[], help="key=value CLI overrides for every run")
    parser.add_argument("--cores", type=int, default=available_cores())
    parser.add_argument("--log_dir", default="runs/warmstart_length")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.warmup_steps % args.val_every:
        parser.error(f"--warmup_steps {args.warmup_steps} must be a multiple of --val_every {args.val_every}: the warm-start's last step must be validated")

    start = time.perf_counter()
    jobs = [Job(key=f"share{share}_seed{seed}", fn=one_run, args=(args, share, seed, args.log_dir))
            for share in args.shares for seed in args.seeds]
    runs = run_jobs(jobs, cores=args.cores)
    record = {
        "benchmark": "warmstart_length",
        "figures": {**summary(runs, args.shares, args.seeds), "wall_s_total": round(time.perf_counter() - start, 1)},
        "per_run": runs,
        "config": {key: value for key, value in vars(args).items()},
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record["figures"], indent=1))


if __name__ == "__main__":
    main()
