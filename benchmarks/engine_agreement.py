"""The vllm engine against the hf engine on a recipe: vLLM's behaviour log-probs against the trainer's
after each weight sync, and rollout throughput beside the hf engine's, both from ``r3l fit`` runs.

Each engine runs the recipe for ``--steps`` RL steps without validation (``r3l fit --config RECIPE``, then
``configs/engine/vllm.yaml`` for vllm, whose weight sync checks log-probs at its first sync and every 10th); the
figures are the runs' own TensorBoard scalars: ``sync/logprob_max_abs_diff`` (the largest |vLLM's
log-prob − the trainer's| on a sample of the step's tokens), ``perf/rollout_tokens_per_s``,
``time/rollout_s``, ``time/step_s``. The engines run one after the other on the same machine, in the
order given, ``--repeats`` times interleaved.

    python -m benchmarks.engine_agreement --config configs/quickstart.yaml --steps 3 \\
        --out benchmarks/results/engine_agreement_smollm2.json
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

TAGS = ("sync/logprob_max_abs_diff", "perf/rollout_tokens_per_s", "time/rollout_s", "time/step_s", "rollout/generated_tokens")
ENGINE_CONFIGS = {"hf": [], "vllm": ["--config", "configs/engine/vllm.yaml"]}


def run(config: list[str], engine: str, steps: int, folder: str) -> dict[str, list[float]]:
    command = [sys.executable, "-m", "r3lightning.cli.console", "fit", *config, *ENGINE_CONFIGS[engine],
               "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
               "--trainer.logger.init_args.save_dir", folder, "--trainer.logger.init_args.name", engine]
    subprocess.run(command, check=True)
    scalars = read_scalars(str(Path(folder, engine)), machine=True)
    return {tag: [value for _, value in scalars[tag]] for tag in TAGS if tag in scalars}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=sorted(ENGINE_CONFIGS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    config = [item for path in args.config for item in ("--config", path)]
    runs: dict[str, list[dict]] = {engine: [] for engine in args.engines}
    for _ in range(args.repeats):
        for engine in args.engines:
            with tempfile.TemporaryDirectory(prefix=f"r3l-{engine}-") as folder:
                runs[engine].append(run(config, engine, args.steps, folder))
    figures = {}
    for engine, repeats in runs.items():
        throughput = [v for r in repeats for v in r.get("perf/rollout_tokens_per_s", [])]
        diffs = [v for r in repeats for v in r.get("sync/logprob_max_abs_diff", [])]
        figures[engine] = {
            "rollout_tokens_per_s_median": statistics.median(throughput) if throughput else None,
            "logprob_max_abs_diff_per_sync": diffs,
            "logprob_max_abs_diff_max": max(diffs) if diffs else None,
            "runs": repeats,
        }
    if "hf" in figures and "vllm" in figures and figures["hf"]["rollout_tokens_per_s_median"]:
        figures["vllm_over_hf_rollout_tokens_per_s"] = figures["vllm"]["rollout_tokens_per_s_median"] / figures["hf"]["rollout_tokens_per_s_median"]
    report = {"benchmark": "engine_agreement", "figures": figures, "config": vars(args), "machine": machine_info()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in figures.items()}, indent=1))


if __name__ == "__main__":
    main()
