"""GRPO vs R³L, its reference-code variant, the reflection baselines and the ablations, from one warm-start.

Per seed, one SFT warm-start of the recipe (default configs/examples/r3l_procedural_d1_cpu.yaml: tiny policy, scripted
expert demonstrations, diagnostician reflections and guided retries) is trained and checkpointed;
every method then resumes from that same checkpoint for the same number of RL steps on the same task
stream, and differs only in its preset (``configs/algorithms/<method>.yaml``, stacked as it is: each
preset sets its whole method, explorer included). Methods spend different amounts of generation
(R³L and Reflect-GRPO also generate reflections and retries), so every run records its generated
tokens beside its validation success; the PNG plots mean greedy success against steps and against
generated tokens.

The methods: ``grpo``, ``r3l`` (the paper), ``r3l_reference`` (the reference code's choices),
``reflect_grpo`` and ``critique_grpo`` (the paper's reflection baselines), and the ablations
``r3l_wo_reflect`` / ``r3l_wo_credit`` / ``r3l_wo_positive``.

    python -m experiments.compare_algorithms --out benchmarks/results/compare_algorithms.json --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

from scripts.machine_info import machine_info
from experiments.schedule import Job, available_cores, run_jobs

# Every preset is an arm; the default comparison is R³L's (paper, reference code, baselines, ablations).
METHODS = {path.stem: ["--config", f"configs/algorithms/{path.name}"] for path in sorted((ROOT / "configs" / "algorithms").glob("*.yaml"))}
DEFAULT_METHODS = (
    "grpo", "r3l", "r3l_reference", "reflect_grpo", "critique_grpo", "r3l_wo_reflect", "r3l_wo_credit", "r3l_wo_positive",
)
# The arms whose objective uses positive amplification's alpha (``--alpha`` overrides theirs).
AMPLIFIED = ("r3l", "r3l_oracle", "r3l_reference", "r3l_wo_reflect", "r3l_wo_credit")


def _fit(overrides: list[str]):
    from r3lightning.callbacks.phase_report import PhaseReport
    from r3lightning.cli.main import R3LightningCLI

    cli = R3LightningCLI(args=["fit", *overrides])
    report = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PhaseReport))
    return cli, report


def _common(args: argparse.Namespace, seed: int, log_dir: str, name: str, max_steps: int) -> list[str]:
    return [
        "--config", args.recipe,
        "--seed_everything", str(seed),
        "--data.seed", str(seed),
        "--trainer.max_steps", str(max_steps),
        "--model.phases.warmstart.steps", str(args.warmup_steps),
        "--trainer.val_check_interval", str(args.val_every),
        # The plot shows the warm-start's curve too.
        "--model.phases.warmstart.validate", "true",
        "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", log_dir,
        "--trainer.logger.init_args.name", name,
    ]


def warm_start(seed: int, args: argparse.Namespace, log_dir: str) -> tuple[str, dict]:
    """Train the shared SFT warm-start of ``seed``; returns its checkpoint and last validation."""
    start = time.perf_counter()
    path = os.path.join(log_dir, f"warmstart_seed{seed}.ckpt")
    if args.reuse_warmstart and os.path.exists(path):
        import torch

        saved = torch.load(path, weights_only=False, map_location="cpu")
        return path, {**saved["callbacks"]["PhaseReport"]["records"][-1], "reused": True}
    # The warm-start's own overrides (e.g. a reflector that reads full transcripts, for r3l_reference).
    own = [arg for override in args.warmstart_override for arg in key_value_args(override)]
    cli, report = _fit([*_common(args, seed, log_dir, f"warmstart_seed{seed}", args.warmup_steps), *own])
    cli.trainer.save_checkpoint(path)
    return path, {**report.records[-1], "wall_s": time.perf_counter() - start}


def demo_overrides(warmstart_overrides: list[str]) -> list[str]:
    """The warm-start overrides an RL run takes too: those of ``model.phases.warmstart.demos``. They only shape the
    warm-start's demonstrations, which no RL step draws, but the config check reads them against the
    warm-up length (a success share starting after a shorter warm-start is refused), so an arm resuming
    a warm-start must describe it as it was trained."""
    return [arg for override in warmstart_overrides if override.startswith("model.phases.warmstart.demos.") for arg in key_value_args(override)]


def run_method(method: str, arm: list[str], seed: int, checkpoint: str, args: argparse.Namespace, log_dir: str) -> dict:
    start = time.perf_counter()
    overrides = [
        *_common(args, seed, log_dir, f"{method}_seed{seed}", args.warmup_steps + args.rl_steps),
        *demo_overrides(args.warmstart_override),
    ]
    alpha = ["--model.algorithm.alpha", str(args.alpha)] if method in AMPLIFIED and args.alpha is not None else []
    # Every method resumes the one warm-start with its own algorithm: the config's values win where the
    # checkpoint's saved ones differ (``--resume_with config``).
    # Strict health: an arm whose switched-on component never acted, or whose update was too large, is
    # refused, not reported.
    from r3lightning.callbacks import HealthRefusal

    health = ["--health.strict", "true", "--health.after_steps", str(args.rl_steps)]
    try:
        cli, report = _fit([*overrides, *arm, *alpha, *health, "--ckpt_path", checkpoint, "--resume_with", "config"])
    except HealthRefusal as err:
        return {"refused": str(err), "wall_s": time.perf_counter() - start}
    series = logged_series(cli.trainer.logger.log_dir, LAST_STEPS_FIGURES)
    records = report.records  # restored from the checkpoint: the warm-start validations come first
    rl_records = [r for r in records if r["step"] > args.warmup_steps]
    return {
        "curve_greedy": [(r["step"], r["val/success_rate_greedy"]) for r in records],
        "curve_sampled": [(r["step"], r["val/success_rate"]) for r in records],
        "final_greedy": records[-1]["val/success_rate_greedy"],
        "final_sampled": records[-1]["val/success_rate"],
        # One validation is a noisy read of a policy that moves several points per step; the mean of
        # the RL phase's last three validations is the steadier figure.
        "last3_mean_greedy": statistics.mean(r["val/success_rate_greedy"] for r in rl_records[-3:]),
        "last3_mean_sampled": statistics.mean(r["val/success_rate"] for r in rl_records[-3:]),
        "rl_rollout_means": report.rollout_means(),
        # What the RL phase generated: episodes plus the reflections, critiques and retries.
        "generated_tokens": report.rollout_means().get("rollout/generated_tokens", 0.0) * args.rl_steps,
        # Per-step figures averaged over the RL phase's last 5 steps (what the policy converged to).
        "last5": {tag: statistics.mean(values[-5:]) for tag, values in series.items() if values},
        "wall_s": time.perf_counter() - start,
    }


PER_SEED_FIGURES = ("rollout/retry_improvement_rate", "rollout/pivot_accuracy", "rollout/success_judgment_samples")
"""RL-phase means printed per seed in the summary figures (where the arm logs them)."""

LAST_STEPS_FIGURES = (
    "rollout/rejected_action_rate", "rollout/response_len_generated", "train/zero_variance_group_rate",
    "rollout/in_context_tokens", "activity/ranking_length_corr", "reward/success_rate",
    # premise gates (issue 62): does the ranking order failures by closeness to success; does a past
    # attempt in context help against the plain samples of the same tasks
    "activity/ranking_credit_corr", "rollout/in_context_success_rate", "rollout/in_context_plain_success_rate",
    # R³L's: the policy gradient's variance across micro-batches, the policy's entropy on its RL tokens
    "train/policy_grad_var_rel", "train/entropy_rl",
)


def logged_series(log_dir: str, tags: tuple[str, ...]) -> dict[str, list[float]]:
    """Each tag's per-step values from a run's TensorBoard event files, in step order."""
    from benchmarks.recipe_run import scalars

    series = scalars(log_dir)
    return {tag: [value for _, value in series[tag]] for tag in tags if tag in series}


def plot(results: dict, path: str, warmup_steps: int) -> None:
    """Mean greedy validation success against optimizer steps, and against generated tokens (the RL
    phase's mean tokens per step times the steps since the warm-start: what each method spent), each
    arm over the seeds it reports (its label gives their number)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, runs in results.items():
        if not runs:
            continue
        steps = [s for s, _ in next(iter(runs.values()))["curve_greedy"]]
        means = [statistics.mean(run["curve_greedy"][i][1] for run in runs.values()) for i in range(len(steps))]
        per_step = statistics.mean(run["rl_rollout_means"].get("rollout/generated_tokens", 0.0) for run in runs.values())
        # Arms with refused runs average fewer seeds: the label says how many.
        by_step.plot(steps, means, marker="o", label=f"{method} (n={len(runs)})")
        rl = [(max(s - warmup_steps, 0) * per_step / 1e3, m) for s, m in zip(steps, means) if s >= warmup_steps]
        by_tokens.plot([x for x, _ in rl], [m for _, m in rl], marker="o", label=f"{method} (n={len(runs)})")
    by_step.set_xlabel("optimizer step")
    by_tokens.set_xlabel("generated tokens in the RL phase (thousands, per rank)")
    for ax in (by_step, by_tokens):
        ax.set_ylabel("validation success (greedy)")
        ax.grid(alpha=0.3)
    by_step.set_title("mean over seeds, by step")
    by_tokens.set_title("mean over seeds, by generation cost")
    by_tokens.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON result path (the PNG goes beside it)")
    parser.add_argument("--recipe", default="configs/examples/r3l_procedural_d1_cpu.yaml")
    parser.add_argument("--methods", nargs="*", default=list(DEFAULT_METHODS),
                        help=f"presets to compare (default: {list(DEFAULT_METHODS)}; any of configs/algorithms)")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=PRESET[,KEY=VALUE...]",
                        help="an extra method: a preset with overrides, e.g. r3l_sft01=r3l,model.algorithm.sft_weight=0.1; "
                             "preset 'recipe' is the recipe's own method")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--warmup_steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--rl_steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--val_every", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--alpha", type=float, default=None,
                        help="positive amplification of the amplifying R³L arms; default: each preset's own")
    parser.add_argument("--shared_warmstart", action="store_true",
                        help="train one warm-start (the first seed's) and start every seed's RL runs from it: "
                             "seeds then vary only the RL phase (sampling, task order stays the recipe's)")
    parser.add_argument("--warmstart_override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of the warm-start only (repeatable), e.g. "
                             "data.explorer.init_args.reflection_transcript=full: its scripted reflections then "
                             "show the reflector's full transcripts (r3l_reference's); use its own --out folder. The RL "
                             "arms take the model.phases.warmstart.demos ones too (demo_overrides)")
    parser.add_argument("--reuse_warmstart", action="store_true",
                        help="use warm-start checkpoints already in the log directory instead of training them")
    parser.add_argument("--reuse_results", nargs="+", default=[],
                        help="earlier result JSONs of this benchmark: their runs of the requested methods and seeds "
                             "are taken as they are (their schedule must match this one), only the others are run")
    parser.add_argument("--cores", type=int, default=available_cores(),
                        help="cores to fill: runs (warm-starts included) go in parallel in separate processes while "
                             "their threads fit (default: the cores this process may use)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per RL run (0: torch's default, every core); the results depend on it, "
                             "so compare runs made at the same count")
    parser.add_argument("--warmstart_threads", type=int, default=None,
                        help="torch threads per warm-start (default: --threads; 0: torch's default, as the "
                             "comparisons before 2026-12-04 trained them)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for spec in args.arm:
        name, arm = parse_arm(spec)
        METHODS[name] = arm
        args.methods.append(name)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; presets: {sorted(METHODS)}, or define them with --arm")
    recipe_defaults(args)
    if args.warmstart_threads is None:
        args.warmstart_threads = args.threads
    log_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "compare_runs")
    results: dict[str, dict[str, dict]] = {method: {} for method in args.methods}
    warm: dict[str, dict] = {}
    start = time.perf_counter()
    # Seeds whose RL runs start from each trained warm-start (all of them with --shared_warmstart).
    trained = args.seeds[:1] if args.shared_warmstart else args.seeds
    starts_of = {seed: (args.seeds if args.shared_warmstart else [seed]) for seed in trained}

    def then(job: Job, result) -> list[Job]:
        """A warm-start makes its seeds' RL runs (those no earlier result JSON has); an RL run is recorded."""
        kind, *key = job.key
        if kind == "rl":
            method, seed = key
            results[method][str(seed)] = result
            print(f"seed {seed} {method}: {json.dumps(result)}", flush=True)
            # Written after every run, so a comparison stopped part-way keeps its finished runs
            # (``--reuse_results`` takes them up).
            write_record(args, results, warm, time.perf_counter() - start)
            return []
        checkpoint, validation = result
        follow = []
        for seed in starts_of[key[0]]:
            warm[str(seed)] = validation
            for path in args.reuse_results:
                for method, runs in reusable_runs(path, argparse.Namespace(**{**vars(args), "seeds": [seed]}),
                                                  {str(seed): validation}).items():
                    results[method].update(runs)
            follow += [Job(("rl", method, seed), run_method, (method, METHODS[method], seed, checkpoint, args, log_dir),
                           threads=args.threads)
                       for method in args.methods if str(seed) not in results[method]]
        return follow

    # Warm-starts first: every RL run waits on one.
    run_jobs([Job(("warm", seed), warm_start, (seed, args, log_dir), threads=args.warmstart_threads, priority=1)
              for seed in trained], args.cores, then)
    figures, results_reported = write_record(args, results, warm, time.perf_counter() - start)
    plot(results_reported, os.path.splitext(args.out)[0] + ".png", args.warmup_steps)
    print(json.dumps(figures, indent=2))


def parse_arm(spec: str) -> tuple[str, list[str]]:
    """``NAME=PRESET[,KEY=VALUE...]`` -> (name, CLI arguments): the preset, then each override.

    ``PRESET`` ``recipe`` stacks no preset: the arm is the recipe's own method (the quickstart's, say),
    with the overrides."""
    name, _, rest = spec.partition("=")
    preset, *overrides = rest.split(",")
    is_preset = (ROOT / "configs" / "algorithms" / f"{preset}.yaml").is_file()
    if not name or not (is_preset or preset == "recipe"):
        raise SystemExit(
            f"--arm {spec!r}: expected NAME=PRESET[,KEY=VALUE...] with a preset in configs/algorithms or 'recipe'"
        )
    arm = ["--config", f"configs/algorithms/{preset}.yaml"] if is_preset else []
    for override in overrides:
        arm += key_value_args(override)
    return name, arm


def key_value_args(override: str) -> list[str]:
    """``KEY=VALUE`` -> ``["--KEY", "VALUE"]``."""
    key, _, value = override.partition("=")
    return [f"--{key}", value]


# What makes two comparisons' runs interchangeable: the same warm-start and the same RL schedule, at the
# same torch thread counts (a run's numbers depend on them).
SCHEDULE_KEYS = ("recipe", "warmup_steps", "rl_steps", "val_every", "alpha", "shared_warmstart", "warmstart_override",
                 "threads", "warmstart_threads")
# Keys that results written before they existed lack, and the value those results ran with (warm-starts
# at torch's default thread count until 2026-12-04).
SCHEDULE_DEFAULTS = {"warmstart_override": [], "threads": 0, "warmstart_threads": 0}


def write_record(
    args: argparse.Namespace, results: dict[str, dict[str, dict]], warm: dict[str, dict], wall_s: Optional[float] = None
) -> tuple[dict, dict[str, dict[str, dict]]]:
    """Write the comparison's JSON (summary figures over the runs finished so far) to ``args.out``;
    return its summary figures and the runs it reports (not refused), by method and seed. ``wall_s``:
    the comparison's wall time so far."""
    results = {m: dict(sorted(runs.items())) for m, runs in results.items()}
    figures = {"warmstart_val_success_greedy_mean": statistics.mean(w["val/success_rate_greedy"] for w in warm.values())}
    # What each part cost: the whole comparison (its runs overlap over the workers), and the summed wall
    # time of each arm's runs, refused ones included (a refusal comes at the end of its run).
    figures["comparison_wall_s"] = wall_s
    trained = args.seeds[:1] if args.shared_warmstart else args.seeds
    figures["warmstart_wall_s_total"] = sum(warm[str(seed)].get("wall_s", 0.0) for seed in trained if str(seed) in warm)
    figures["wall_s_total_by_arm"] = {m: sum(run["wall_s"] for run in runs.values()) for m, runs in results.items() if runs}
    refused = {m: {s: run["refused"] for s, run in runs.items() if "refused" in run} for m, runs in results.items()}
    figures["refused_runs"] = {m: r for m, r in refused.items() if r}
    results_reported = {m: {s: run for s, run in runs.items() if "refused" not in run} for m, runs in results.items()}
    for method, runs in results_reported.items():
        if not runs:
            continue
        for kind in ("greedy", "sampled"):
            finals = [run[f"final_{kind}"] for run in runs.values()]
            figures[f"{method}_final_val_success_{kind}_mean"] = statistics.mean(finals)
            figures[f"{method}_final_val_success_{kind}_std"] = statistics.stdev(finals) if len(finals) > 1 else 0.0
            figures[f"{method}_final_val_success_{kind}_min"] = min(finals)
            figures[f"{method}_last3_val_success_{kind}_mean"] = statistics.mean(run[f"last3_mean_{kind}"] for run in runs.values())
        figures[f"{method}_wall_s_mean"] = statistics.mean(run["wall_s"] for run in runs.values())
        figures[f"{method}_generated_tokens_mean"] = statistics.mean(run.get("generated_tokens", 0.0) for run in runs.values())
        # The retry channel per seed (R³L arms): retries that beat their base, and pivots on the diagnostician's.
        for tag in PER_SEED_FIGURES:
            per_seed = {seed: run["rl_rollout_means"][tag] for seed, run in runs.items() if tag in run["rl_rollout_means"]}
            if per_seed:
                figures[f"{method}_{tag.split('/')[-1]}_per_seed"] = per_seed
    record = {
        "benchmark": "compare_algorithms",
        "figures": figures,
        "warm_start": warm,
        "per_seed": results,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": machine_info(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=2)
    return figures, results_reported


def reusable_runs(path: str, args: argparse.Namespace, warm: Optional[dict[str, dict]] = None) -> dict[str, dict[str, dict]]:
    """The runs of ``args.methods`` x ``args.seeds`` already in the result JSON at ``path``.

    Raises ValueError, naming the file and the setting, when its schedule differs from ``args``'s, or,
    given this comparison's warm-start validations ``warm`` (by seed), when a seed's warm-start there
    validated differently: a warm-start retrained on another machine (the runs are deterministic per
    thread count on one machine, not across processors) or by other code is another starting point,
    and its runs cannot be paired with this comparison's.
    """
    previous = json.loads(Path(path).read_text())
    for key in SCHEDULE_KEYS:
        theirs = previous["config"].get(key, SCHEDULE_DEFAULTS.get(key))
        if theirs != getattr(args, key):
            raise ValueError(f"{path}: its runs used {key}={theirs!r}, this comparison "
                             f"{key}={getattr(args, key)!r}; they cannot be mixed")
    for seed, ours in (warm or {}).items():
        theirs = previous.get("warm_start", {}).get(seed)
        if theirs is None:
            continue
        differing = {k: (theirs.get(k), v) for k, v in ours.items() if k.startswith("val/") and theirs.get(k) != v}
        if differing:
            raise ValueError(f"{path}: seed {seed}'s warm-start validated {differing} (there, here): another "
                             "starting point (another machine or code); rerun those arms instead of reusing them")
    return {
        method: {str(seed): previous["per_seed"][method][str(seed)]
                 for seed in args.seeds if str(seed) in previous["per_seed"].get(method, {})}
        for method in args.methods
    }


def recipe_defaults(args: argparse.Namespace) -> None:
    """Fill unset step counts from the recipe, so the comparison runs the recipe's schedule."""
    import yaml

    recipe = yaml.safe_load(Path(args.recipe).read_text())
    if args.warmup_steps is None:
        args.warmup_steps = recipe["model"]["phases"]["warmstart"]["steps"]
    if args.rl_steps is None:
        args.rl_steps = recipe["trainer"]["max_steps"] - args.warmup_steps
    if args.val_every is None:
        args.val_every = recipe["trainer"]["val_check_interval"]


if __name__ == "__main__":
    main()
