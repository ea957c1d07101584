"""Two methods' validation curves on the generated-token axis, paired by seed: at each validation of the
method under test, the baseline's success at the same number of generated tokens (linear between its
own validations), and the same comparison at equal RL steps; one JSON and one plot.

Each ``--arm NAME=FOLDER`` is a folder of runs ``seed<S>`` (``experiments.recipe_seeds``'s layout); a
run's validation history comes from its ``phase_report.json``, its spending per step from TensorBoard
(``rollout/generated_tokens``: every token the engine generated, reflections and retries included;
``time/step_s``). The tokens at a validation after step ``s`` are those of steps ``0 .. s-1``.

    python -m experiments.equal_tokens --arm grpo=RUNS/grpo --arm r3l=RUNS/r3l --seeds 0 1 2 \\
        --out benchmarks/results/r3l_vs_grpo_smollm2/r3l_vs_grpo.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from experiments.recipe_seeds import GREEDY, SAMPLED, mean_se
from scripts.machine_info import machine_info
from scripts.refactor_equivalence import read_scalars

TRAINING_FIGURES = ("reward/success_rate", "reward/success_rate_base", "rollout/truncated_rate", "rollout/response_len",
                    "rollout/retry_rate", "rollout/retry_improvement_rate", "rollout/reflection_invalid_rate")
"""Per-step figures summarized per run (where logged): the mean over the run's first and last quarter of steps."""


def cumulative_at(per_step: list[tuple[int, float]], steps: list[int]) -> list[float]:
    """The sum of a per-step quantity over steps ``0 .. s-1`` for each ``s`` in ``steps``."""
    return [sum(value for step, value in per_step if step < s) for s in steps]


def curve(folder: Path) -> dict:
    """One run's validations: step, greedy and sampled success, generated tokens and step seconds so far."""
    report = json.loads((folder / "phase_report.json").read_text())
    scalars = read_scalars(str(folder), machine=True)
    steps = [record["step"] for record in report["history"]]
    return {
        "steps": steps,
        "greedy": [record[GREEDY] for record in report["history"]],
        "sampled": [record[SAMPLED] for record in report["history"]],
        "tokens": cumulative_at(scalars["rollout/generated_tokens"], steps),
        "step_seconds": cumulative_at(scalars["time/step_s"], steps),
        "training": {tag: quarters([value for _, value in scalars[tag]]) for tag in TRAINING_FIGURES if tag in scalars},
    }


def quarters(values: list[float]) -> dict:
    """The mean of the first and of the last quarter of a per-step series (at least one step each)."""
    n = max(len(values) // 4, 1)
    return {"first_quarter": statistics.mean(values[:n]), "last_quarter": statistics.mean(values[-n:]), "steps": len(values)}


def interpolate(x: float, xs: list[float], ys: list[float]) -> float | None:
    """``ys`` at ``x`` along the piecewise-linear curve through (xs, ys), xs increasing; None outside it."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def paired(baseline: dict, tested: dict, axis: str, metric: str) -> list[dict]:
    """At each validation of ``tested`` after its first, the baseline's ``metric`` at the same ``axis``
    value (tokens or steps), and the difference; points past the baseline's last validation are left out."""
    points = []
    for x, y in list(zip(tested[axis], tested[metric]))[1:]:
        base = interpolate(x, baseline[axis], baseline[metric])
        if base is not None:
            points.append({axis: x, "tested": y, "baseline": base, "difference": y - base})
    return points


def compare(curves: dict[str, dict[int, dict]], baseline: str, tested: str, seeds: list[int]) -> dict:
    """Per seed and over seeds: the tested arm's last validation against the baseline at equal tokens and at
    equal steps, greedy and sampled; and every paired point."""
    figures: dict = {"per_seed": {}}
    for seed in seeds:
        base, test = curves[baseline][seed], curves[tested][seed]
        figures["per_seed"][str(seed)] = {
            f"{metric}_at_equal_{axis}": paired(base, test, axis, metric)
            for axis in ("tokens", "steps") for metric in ("greedy", "sampled")
        }
    for axis in ("tokens", "steps"):
        for metric in ("greedy", "sampled"):
            last = [figures["per_seed"][str(s)][f"{metric}_at_equal_{axis}"] for s in seeds]
            if all(last):
                figures[f"last_{metric}_difference_at_equal_{axis}"] = mean_se([points[-1]["difference"] for points in last])
    # Each arm's last validation, whatever it spent: when the tested arm spent more tokens than the baseline's
    # whole run, this is the comparison at the tokens the baseline stopped at or beyond.
    figures["final_greedy_difference"] = mean_se([curves[tested][s]["greedy"][-1] - curves[baseline][s]["greedy"][-1] for s in seeds])
    figures["final_tokens_ratio"] = mean_se([curves[tested][s]["tokens"][-1] / curves[baseline][s]["tokens"][-1] for s in seeds])
    for arm in (baseline, tested):
        figures[f"{arm}_final"] = {
            "greedy": mean_se([curves[arm][s]["greedy"][-1] for s in seeds]),
            "sampled": mean_se([curves[arm][s]["sampled"][-1] for s in seeds]),
            "steps": [curves[arm][s]["steps"][-1] for s in seeds],
            "generated_tokens": [curves[arm][s]["tokens"][-1] for s in seeds],
            "step_seconds": [round(curves[arm][s]["step_seconds"][-1], 1) for s in seeds],
        }
        tokens_per_step = [curves[arm][s]["tokens"][-1] / curves[arm][s]["steps"][-1] for s in seeds]
        figures[f"{arm}_tokens_per_step"] = mean_se(tokens_per_step)
        tags = set.intersection(*(set(curves[arm][s].get("training", {})) for s in seeds))
        figures[f"{arm}_training"] = {
            tag: {part: mean_se([curves[arm][s]["training"][tag][part] for s in seeds]) for part in ("first_quarter", "last_quarter")}
            for tag in sorted(tags)
        }
    return figures


def plot(curves: dict[str, dict[int, dict]], seeds: list[int], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.6), layout="constrained")
    by_tokens, by_steps = figure.subplots(1, 2, sharey=True)
    colours = ["tab:blue", "tab:red", "tab:green", "tab:purple"]
    for colour, (arm, runs) in zip(colours, curves.items()):
        for index, seed in enumerate(seeds):
            run = runs[seed]
            label = arm if index == 0 else None
            by_tokens.plot([t / 1000 for t in run["tokens"]], run["greedy"], marker="o", color=colour, alpha=0.7, label=label)
            by_steps.plot(run["steps"], run["greedy"], marker="o", color=colour, alpha=0.7, label=label)
    by_tokens.set_xlabel("generated tokens (thousands)")
    by_steps.set_xlabel("RL step")
    by_tokens.set_ylabel("greedy validation success")
    by_tokens.set_ylim(0, 1)
    by_tokens.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", action="append", required=True, help="NAME=FOLDER of seed<S> runs; the first is the baseline")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    arms = dict(spec.split("=", 1) for spec in args.arm)
    if len(arms) != 2:
        parser.error("give exactly two --arm NAME=FOLDER (baseline first)")
    curves = {name: {seed: curve(Path(folder) / f"seed{seed}") for seed in args.seeds} for name, folder in arms.items()}
    baseline, tested = list(arms)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "equal_tokens",
        "figures": compare(curves, baseline, tested, args.seeds),
        "config": {"arms": arms, "baseline": baseline, "tested": tested, "seeds": args.seeds,
                   "error_bar": "standard error of the per-seed values",
                   "curves": {name: {str(s): c for s, c in runs.items()} for name, runs in curves.items()}},
        "machine": machine_info(),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(curves, args.seeds, out.with_suffix(".png"), f"{tested} against {baseline}, paired by seed")
    for axis in ("tokens", "steps"):
        key = f"last_greedy_difference_at_equal_{axis}"
        if key in report["figures"]:
            d = report["figures"][key]
            print(f"{tested} - {baseline}, greedy at equal {axis}: {100 * d['mean']:+.1f} ± {100 * d['stderr']:.1f} points (SE, {d['seeds']} seeds)")
    print(out)


if __name__ == "__main__":
    main()
