"""R³L's premise gates (issue 62), paired over seeds from one warm-start: does pivotal credit lower the
variance of the policy gradient, and does positive amplification keep the policy's entropy up, in a
sparse-success regime?

It runs ``experiments.compare_algorithms`` with the gate's arms, every one logging the policy loss's
gradient variance across micro-batches (``model.log_grad_variance``) and its entropy on RL tokens
(``train/entropy_rl``), then pairs them per seed. Three gates (``--gate``):

- ``credit``: ``r3l``, ``r3l_wo_credit`` and ``r3l_wo_positive`` on the difficulty-2 procedural world
  (``configs/examples/r3l_procedural_d2_cpu.yaml``) from a 320-step warm-start (the recipe's 600 steps
  leave ~90%; 320 leave about half the samples succeeding: the dense regime). Pivotal credit needs
  retries, so the policy must write reflections: the warm-start teaches them. Pairs:
  ``train/policy_grad_var_rel`` and ``train/policy_grad_var`` of r3l against r3l_wo_credit;
  ``train/entropy_rl`` of r3l against r3l_wo_positive.
- ``credit_sparse``: ``r3l`` against ``r3l_wo_credit`` (the gradient pairs) from a 220-step
  warm-start, as the policy starts to act on the goal (sparse success).
- ``amplification``: on the arithmetic recipe (``configs/examples/r3_arithmetic_cpu.yaml``: about 7%
  success after its 80-step warm-start, most groups all-fail), the recipe's GRPO with the paper's
  positive amplification (α = 3, ``max_reward_mode: alpha``) against the same with
  ``positive_amplification: false``, so amplification is the only difference. Pairs:
  ``train/entropy_rl`` and the gradient figures, amplified against not. Micro-batches of 32 rows, so a
  step has 4 to estimate its gradient's variance from.

Figures: means over the RL steps (and the last 5 for the entropy), per seed; mean ± standard error of
each paired difference (sample sd / √n over seeds); the warm-start's and the RL steps' success (the
regime). Written to ``--out`` (the comparison's own JSON and plot beside it, ``*_comparison.*``).

    nice -n 19 python -m experiments.r3l_gates --gate amplification --seeds 0 1 2 3 4 5 6 7 8 9 \\
        --out benchmarks/results/r3l_gates/amplification.json
    nice -n 19 python -m experiments.r3l_gates --gate credit --seeds 0 1 2 3 4 5 6 7 8 9 \\
        --out benchmarks/results/r3l_gates/credit.json
    nice -n 19 python -m experiments.r3l_gates --gate credit_sparse --seeds 0 1 2 3 4 5 6 7 8 9 \\
        --out benchmarks/results/r3l_gates/credit_sparse.json
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

# The update-size guard (health.update_kl_max) is for pretrained models; a tiny policy's RL step may pass
# it, and the gate compares the same arms on every seed rather than refusing some of them.
COMMON = "model.log_grad_variance=true,health.update_kl_max=null"
AMPLIFICATION = "model.algorithm.alpha=3.0,model.algorithm.max_reward_mode=alpha,model.optim.micro_batch_size=32"
GATES = {
    "credit": {
        "recipe": "configs/examples/r3l_procedural_d2_cpu.yaml",
        "warmup_steps": 320,
        "rl_steps": 10,
        # The recipe's success judgments start at step 480: inside the shortened warm-start instead. No
        # periodic validation in it (only its last step's).
        "warmstart_override": ["model.phases.warmstart.demos.success_reflection_from_step=240",
                               "model.phases.warmstart.validate=false"],
        "arms": {"r3l": f"r3l,{COMMON}", "r3l_wo_credit": f"r3l_wo_credit,{COMMON}", "r3l_wo_positive": f"r3l_wo_positive,{COMMON}"},
        "pairs": {
            "train/policy_grad_var_rel": ("r3l", "r3l_wo_credit"),
            "train/policy_grad_var": ("r3l", "r3l_wo_credit"),
            "train/entropy_rl": ("r3l", "r3l_wo_positive"),
        },
    },
    # Pivotal credit where success is sparse: the warm-start stops at step 220, as the policy starts to act
    # on the goal (after 200 steps it succeeded on none of the validation tasks and 0.5% of the RL samples,
    # so no step had a gradient to compare; after 240 on 36% greedy, 33% sampled), with the success
    # judgments taught from step 180.
    "credit_sparse": {
        "recipe": "configs/examples/r3l_procedural_d2_cpu.yaml",
        "warmup_steps": 220,
        "rl_steps": 10,
        "warmstart_override": ["model.phases.warmstart.demos.success_reflection_from_step=180",
                               "model.phases.warmstart.validate=false"],
        # Amplification's entropy premise already has its sparse gate (``amplification``).
        "arms": {"r3l": f"r3l,{COMMON}", "r3l_wo_credit": f"r3l_wo_credit,{COMMON}"},
        "pairs": {
            "train/policy_grad_var_rel": ("r3l", "r3l_wo_credit"),
            "train/policy_grad_var": ("r3l", "r3l_wo_credit"),
        },
    },
    "amplification": {
        "recipe": "configs/examples/r3_arithmetic_cpu.yaml",
        "warmup_steps": 80,
        "rl_steps": 20,
        "warmstart_override": ["model.phases.warmstart.validate=false"],
        # The recipe's own method (GRPO, its explorer: an R³L preset's explorer would change the in-memory
        # tokenizer the warm-start was trained with) with the paper's amplification switched on or off.
        "arms": {
            "amplified": f"recipe,{COMMON},{AMPLIFICATION},model.algorithm.positive_amplification=true",
            "not_amplified": f"recipe,{COMMON},{AMPLIFICATION},model.algorithm.positive_amplification=false",
        },
        "pairs": {
            "train/entropy_rl": ("amplified", "not_amplified"),
            "train/policy_grad_var_rel": ("amplified", "not_amplified"),
            "train/policy_grad_var": ("amplified", "not_amplified"),
        },
    },
}
REGIME = ("reward/success_rate", "train/zero_variance_group_rate", "train/policy_grad_chunks")


def paired(arm: dict[str, float], control: dict[str, float]) -> dict:
    """Per-seed differences ``arm − control`` over the seeds both have, their mean and its standard error
    (sample sd / √n; nan below 2 seeds), and each side's mean."""
    seeds = sorted(set(arm) & set(control), key=int)
    diffs = [arm[s] - control[s] for s in seeds]
    n = len(diffs)
    nan = float("nan")
    return {
        "seeds": seeds,
        "arm_per_seed": {s: arm[s] for s in seeds},
        "control_per_seed": {s: control[s] for s in seeds},
        "difference_per_seed": dict(zip(seeds, diffs)),
        "difference_mean": statistics.mean(diffs) if diffs else nan,
        "difference_se": statistics.stdev(diffs) / math.sqrt(n) if n > 1 else nan,
        "arm_mean": statistics.mean(arm[s] for s in seeds) if seeds else nan,
        "control_mean": statistics.mean(control[s] for s in seeds) if seeds else nan,
    }


def summarize(comparison: dict, gate: dict) -> dict:
    """The gate figures of a compare_algorithms JSON whose arms are ``gate["arms"]``."""
    per_seed = comparison["per_seed"]

    def figure(arm: str, tag: str, where: str = "rl_rollout_means") -> dict[str, float]:
        return {s: run[where][tag] for s, run in per_seed.get(arm, {}).items() if "refused" not in run and tag in run.get(where, {})}

    pairs = {}
    for tag, (arm, control) in gate["pairs"].items():
        pairs[f"{tag} ({arm} - {control}), mean over RL steps"] = paired(figure(arm, tag), figure(control, tag))
        if tag == "train/entropy_rl":
            pairs[f"{tag} ({arm} - {control}), last 5 RL steps"] = paired(figure(arm, tag, "last5"), figure(control, tag, "last5"))
    regime = {arm: {tag: figure(arm, tag) for tag in REGIME} for arm in gate["arms"]}
    regime["warm_start_val_success_greedy"] = {s: w["val/success_rate_greedy"] for s, w in comparison["warm_start"].items()}
    final = {arm: {s: run["final_greedy"] for s, run in per_seed.get(arm, {}).items() if "refused" not in run} for arm in gate["arms"]}
    refused = {arm: {s: run["refused"] for s, run in per_seed.get(arm, {}).items() if "refused" in run} for arm in gate["arms"]}
    return {"pairs": pairs, "regime_per_seed": regime, "final_val_success_greedy_per_seed": final, "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the gates' JSON (the comparison's own JSON goes beside it)")
    parser.add_argument("--gate", choices=sorted(GATES), required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(10)))
    parser.add_argument("--rl_steps", type=int, default=None, help="default: the gate's")
    parser.add_argument("--cores", type=int, default=1)
    parser.add_argument("--reuse_warmstart", action="store_true")
    parser.add_argument("--summarize_only", action="store_true", help="read the comparison JSON beside --out, run nothing")
    args = parser.parse_args()
    gate = GATES[args.gate]
    rl_steps = args.rl_steps or gate["rl_steps"]
    out = Path(args.out)
    comparison_path = out.with_name(out.stem + "_comparison.json")
    command = [
        sys.executable, "-m", "experiments.compare_algorithms", "--recipe", gate["recipe"], "--out", str(comparison_path),
        "--methods", "--seeds", *map(str, args.seeds), "--shared_warmstart",
        "--warmup_steps", str(gate["warmup_steps"]), "--rl_steps", str(rl_steps), "--val_every", str(rl_steps),
        "--cores", str(args.cores), "--threads", "1",
        *[a for override in gate["warmstart_override"] for a in ("--warmstart_override", override)],
        *(["--reuse_warmstart"] if args.reuse_warmstart else []),
    ]
    for name, spec in gate["arms"].items():
        command += ["--arm", f"{name}={spec}"]
    if not args.summarize_only:
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    comparison = json.loads(comparison_path.read_text())
    record = {
        "benchmark": "r3l_gates",
        "figures": summarize(comparison, gate),
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "gate_spec": gate, "rl_steps": rl_steps,
                   "comparison": comparison_path.name, "command": ["python", *command[1:]]},
        "machine": machine_info(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    for name, pair in record["figures"]["pairs"].items():
        print(f"{name}: {pair['difference_mean']:+.4g} ± {pair['difference_se']:.2g} (standard error, {len(pair['seeds'])} seeds; "
              f"{pair['arm_mean']:.4g} vs {pair['control_mean']:.4g})")


if __name__ == "__main__":
    main()
