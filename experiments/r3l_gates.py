"""R³L's premise gates (issue 62), paired over seeds from one warm-start: does pivotal credit lower the
variance of the policy gradient, and does positive amplification keep the policy's entropy up, in a
sparse-success regime?

It runs ``experiments.compare_algorithms`` with three arms, every one logging the policy loss's gradient
variance across micro-batches (``model.log_grad_variance``): ``r3l`` (the preset), ``r3l_wo_credit`` and
``r3l_wo_positive``, on ``--recipe`` with a shortened warm-start (sparse success: the regime where the
paper says GRPO's entropy collapses and credit matters), then pairs them per seed:

- gradient gate: ``train/policy_grad_var_rel`` (trace of Var[gradient] / ‖gradient‖², scale free; means
  over the RL steps) and ``train/policy_grad_var``, r3l against r3l_wo_credit;
- entropy gate: ``train/entropy_rl`` (the policy's entropy on its RL tokens; mean over the RL steps and
  over the last 5), r3l against r3l_wo_positive;

and writes per-seed figures, mean ± standard error of each paired difference (sd / √n over seeds),
the warm-start's success and the RL steps' success rate (the regime) to ``--out``.

    nice -n 19 python -m experiments.r3l_gates --seeds 0 1 2 3 4 5 6 7 8 9 \\
        --out benchmarks/results/r3l_gates/r3l_gates.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from scripts.machine_info import machine_info

ARMS = ("r3l", "r3l_wo_credit", "r3l_wo_positive")
GATES = {
    # figure -> (arm, control): the figure of ``arm`` against the arm without the component
    "train/policy_grad_var_rel": ("r3l", "r3l_wo_credit"),
    "train/policy_grad_var": ("r3l", "r3l_wo_credit"),
    "train/entropy_rl": ("r3l", "r3l_wo_positive"),
}
REGIME = ("reward/success_rate", "train/zero_variance_group_rate", "train/policy_grad_chunks")


def paired(arm: dict[str, float], control: dict[str, float]) -> dict:
    """Per-seed differences ``arm − control`` over the seeds both have, their mean and its standard error
    (sample sd / √n; nan below 2 seeds), and each side's mean."""
    seeds = sorted(set(arm) & set(control), key=int)
    diffs = [arm[s] - control[s] for s in seeds]
    n = len(diffs)
    return {
        "seeds": seeds,
        "difference_per_seed": dict(zip(seeds, diffs)),
        "difference_mean": statistics.mean(diffs) if diffs else float("nan"),
        "difference_se": statistics.stdev(diffs) / math.sqrt(n) if n > 1 else float("nan"),
        "arm_mean": statistics.mean(arm[s] for s in seeds) if seeds else float("nan"),
        "control_mean": statistics.mean(control[s] for s in seeds) if seeds else float("nan"),
        "ratio_of_means": (statistics.mean(arm[s] for s in seeds) / statistics.mean(control[s] for s in seeds)) if seeds else float("nan"),
    }


def summarize(comparison: dict) -> dict:
    """The gate figures of a compare_algorithms JSON whose arms are ``ARMS``."""
    per_seed = comparison["per_seed"]

    def figure(arm: str, tag: str, where: str = "rl_rollout_means") -> dict[str, float]:
        return {s: run[where][tag] for s, run in per_seed.get(arm, {}).items() if "refused" not in run and tag in run.get(where, {})}

    gates = {}
    for tag, (arm, control) in GATES.items():
        gates[f"{tag} ({arm} - {control}), mean over RL steps"] = paired(figure(arm, tag), figure(control, tag))
    gates[f"train/entropy_rl (r3l - r3l_wo_positive), last 5 RL steps"] = paired(
        figure("r3l", "train/entropy_rl", "last5"), figure("r3l_wo_positive", "train/entropy_rl", "last5"))
    regime = {arm: {tag: figure(arm, tag) for tag in REGIME} for arm in ARMS}
    regime["warm_start_val_success_greedy"] = {s: w["val/success_rate_greedy"] for s, w in comparison["warm_start"].items()}
    final = {arm: {s: run["final_greedy"] for s, run in per_seed.get(arm, {}).items() if "refused" not in run} for arm in ARMS}
    refused = {arm: {s: run["refused"] for s, run in per_seed.get(arm, {}).items() if "refused" in run} for arm in ARMS}
    return {"gates": gates, "regime_per_seed": regime, "final_val_success_greedy_per_seed": final, "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the gates' JSON (the comparison's own JSON goes beside it)")
    parser.add_argument("--recipe", default="configs/examples/r3l_procedural_d2_cpu.yaml")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(10)))
    parser.add_argument("--warmup_steps", type=int, default=320,
                        help="a warm-start short enough that RL starts in sparse success (the recipe's 600 leaves ~90%%)")
    parser.add_argument("--rl_steps", type=int, default=10)
    parser.add_argument("--warmstart_override", action="append", default=["model.phases.warmstart.demos.success_reflection_from_step=240"],
                        help="warm-start overrides (repeatable); the default starts the recipe's success judgments "
                             "inside the shortened warm-start")
    parser.add_argument("--cores", type=int, default=1)
    parser.add_argument("--reuse_warmstart", action="store_true")
    parser.add_argument("--summarize_only", action="store_true", help="read the comparison JSON beside --out, run nothing")
    args = parser.parse_args()
    out = Path(args.out)
    comparison_path = out.with_name(out.stem + "_comparison.json")
    command = [
        sys.executable, "-m", "experiments.compare_algorithms", "--recipe", args.recipe, "--out", str(comparison_path),
        "--methods", *[], "--seeds", *map(str, args.seeds), "--shared_warmstart",
        "--warmup_steps", str(args.warmup_steps), "--rl_steps", str(args.rl_steps), "--val_every", str(args.rl_steps),
        "--cores", str(args.cores), "--threads", "1",
        *[a for override in args.warmstart_override for a in ("--warmstart_override", override)],
        *(["--reuse_warmstart"] if args.reuse_warmstart else []),
    ]
    # The update-size guard (health.update_kl_max) is for pretrained models; the tiny policy's RL steps may
    # exceed it, and the comparison only catches refusals of inert components.
    for arm in ARMS:
        command += ["--arm", f"{arm}={arm},model.log_grad_variance=true,health.update_kl_max=null"]
    if not args.summarize_only:
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    comparison = json.loads(comparison_path.read_text())
    record = {
        "benchmark": "r3l_gates",
        "figures": summarize(comparison),
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "comparison": str(comparison_path), "command": command[1:]},
        "machine": machine_info(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    for name, gate in record["figures"]["gates"].items():
        print(f"{name}: {gate['difference_mean']:+.4g} ± {gate['difference_se']:.2g} (standard error, {len(gate['seeds'])} seeds; "
              f"{gate['arm_mean']:.4g} vs {gate['control_mean']:.4g})")


if __name__ == "__main__":
    main()
