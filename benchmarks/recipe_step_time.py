"""Time per RL step of each method's recipe on the real model (SmolLM2-135M-Instruct), and what a step
generates: each recipe runs ``--steps`` steps of ``r3l fit`` with no validation, in its own process, one
after another, ``--repeats`` times in turn (GRPO, R³L, Reflect-GRPO, R³, GRPO, R³L, ...).

    python -m benchmarks.recipe_step_time --steps 3 --repeats 1 --out benchmarks/results/recipe_step_time_smollm2_cpu.json

Per recipe: the median of ``time/step_s`` over its steps after the first (the first also builds the
optimizer state and warms the engine), its rollout and update parts (``time/rollout_s``,
``time/train_s``), the generated tokens per step (``rollout/generated_tokens``: episodes plus
reflections and retries) and the ratio of each to GRPO's. ReflectRL's recipe trains its stage 1 (SFT)
first; it is timed by ``--reflectrl`` (its config and the two files its header builds) over stage-2
steps, whose ``time/step_s`` includes the teacher's forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.machine_info import machine_info
from scripts.refactor_equivalence import read_scalars

QUICKSTART = "configs/quickstart.yaml"
RECIPES = {
    "grpo": [QUICKSTART],
    "r3l": [QUICKSTART, "configs/algorithms/r3l.yaml", "configs/examples/smollm2_text_reflections.yaml"],
    "reflect_grpo": [QUICKSTART, "configs/algorithms/reflect_grpo.yaml", "configs/examples/smollm2_reflect_grpo.yaml"],
    "r3": [QUICKSTART, "configs/algorithms/r3.yaml", "configs/examples/smollm2_r3.yaml"],
}
"""Method -> the configs ``r3l fit`` stacks (docs/results.md, "Recipes on the real model")."""
TAGS = ("time/step_s", "time/rollout_s", "time/train_s", "rollout/generated_tokens")
NO_VALIDATION = ["--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0"]


def run_recipe(configs: list[str], steps: int, folder: Path, extra: list[str]) -> list[dict]:
    """Run ``steps`` steps of the stacked ``configs`` logging under ``folder``; its per-step figures
    (``[{"step": ..., tag: value}]``)."""
    command = [sys.executable, "-m", "r3lightning.cli.console", "fit"]
    for config in configs:
        command += ["--config", config]
    command += [
        "--trainer.max_steps", str(steps), *NO_VALIDATION, "--trainer.callbacks", "[]",
        "--trainer.logger.init_args.save_dir", str(folder.parent), "--trainer.logger.init_args.name", folder.name,
        "--trainer.logger.init_args.version", "run", *extra,
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    scalars = read_scalars(str(folder), machine=True)
    by_step: dict[int, dict] = {}
    for tag in TAGS:
        for step, value in scalars.get(tag, []):
            by_step.setdefault(step, {})[tag] = value
    return [{"step": step, **values} for step, values in sorted(by_step.items())]


def summarize(per_repeat: list[list[dict]]) -> dict:
    """Medians over every repeat's RL steps (those that generated tokens) after its first."""
    pooled = {tag: [] for tag in TAGS}
    for steps in per_repeat:
        rl = [row for row in steps if row.get("rollout/generated_tokens", 0) > 0][1:]
        for tag in TAGS:
            pooled[tag] += [row[tag] for row in rl if tag in row]
    return {f"{tag.split('/')[1]}_median": statistics.median(values) if values else None for tag, values in pooled.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--steps", type=int, default=3, help="RL steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--reflectrl", default=None, help="ReflectRL's config, its pool and SFT file already built; "
                        "timed over --steps stage-2 steps after its stage 1")
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    recipes = {method: RECIPES[method] for method in args.methods}
    if args.reflectrl:
        recipes["reflectrl"] = [args.reflectrl]
    runs: dict[str, list[list[dict]]] = {method: [] for method in recipes}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for method, configs in recipes.items():
                steps = args.steps
                if method == "reflectrl":
                    import yaml

                    steps += yaml.safe_load(Path(configs[0]).read_text())["model"]["phases"]["warmstart"]["steps"]
                runs[method].append(run_recipe(configs, steps, Path(scratch) / f"{method}_{repeat}", extra))
    figures = {method: summarize(per_repeat) for method, per_repeat in runs.items()}
    grpo = figures.get("grpo")
    if grpo:
        for method, row in figures.items():
            row["step_over_grpo"] = row["step_s_median"] / grpo["step_s_median"]
            row["tokens_over_grpo"] = row["generated_tokens_median"] / grpo["generated_tokens_median"]
    report = {
        "benchmark": "recipe_step_time",
        "figures": figures,
        "config": {"recipes": recipes, "steps": args.steps, "repeats": args.repeats, "extra_args": extra},
        "runs": runs,
        "machine": machine_info(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    for method, row in figures.items():
        print(f"{method:13s} step {row['step_s_median']:.1f} s (rollout {row['rollout_s_median']:.1f}, train "
              f"{row['train_s_median']:.1f}), {row['generated_tokens_median']:.0f} generated tokens"
              + (f", {row['step_over_grpo']:.2f}x GRPO's step" if grpo else ""))


if __name__ == "__main__":
    main()
