"""One recipe run, its logged scalars kept: ``r3l fit`` with the given configs, then every scalar the
run wrote to TensorBoard, per step, in one JSON beside the step-time split (rollout / train / other)
and the peak GPU memory. For a GPU session (``scripts/gpu_session.sh``), where only a few files come
back and TensorBoard's folders are too deep to.

    python -m benchmarks.recipe_run --out $OUT/recipe_gpu_r3l_math.json \\
        --config configs/recipes/r3l_math_qwen2.5-1.5b.yaml --config benchmarks/recipe_gpu_override.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from scripts.machine_info import machine_info  # noqa: E402

SPLIT_TAGS = ("time/step_s", "time/rollout_s", "time/train_s")


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in ``log_dir``'s event files: (step, value) pairs in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in sorted(events.Scalars(tag), key=lambda e: e.step)]
            for tag in events.Tags().get("scalars", [])}


def step_split(series: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """Medians over the run's steps of its whole step, rollout and update seconds, and the rest."""
    medians = {tag: statistics.median(v for _, v in series[tag]) for tag in SPLIT_TAGS if series.get(tag)}
    if len(medians) == len(SPLIT_TAGS):
        medians["time/other_s"] = medians["time/step_s"] - medians["time/rollout_s"] - medians["time/train_s"]
    return {f"{tag}_median": round(value, 4) for tag, value in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--config", action="append", required=True, help="a config for r3l fit (repeatable, stacked in order)")
    parser.add_argument("overrides", nargs="*", help="further r3l fit arguments, e.g. --trainer.max_steps 5")
    args = parser.parse_args()
    from r3lightning.cli.main import R3LightningCLI

    save_dir = tempfile.mkdtemp(prefix="recipe_run_")
    fit_args = ["fit", *[a for c in args.config for a in ("--config", c)], *args.overrides,
                "--trainer.logger.init_args.save_dir", save_dir]
    start = time.perf_counter()
    sys.argv = sys.argv[:1]  # the fit's arguments are ``fit_args``; LightningCLI warns when both are given
    cli = R3LightningCLI(args=fit_args)
    wall_s = time.perf_counter() - start
    series = scalars(cli.trainer.logger.log_dir)
    figures = {"steps": cli.trainer.global_step, "wall_s": round(wall_s, 1), **step_split(series)}
    generated = [v for _, v in series.get("rollout/generated_tokens", [])]
    if generated:
        figures["generated_tokens_per_step_mean"] = round(statistics.mean(generated), 1)
    import torch

    if torch.cuda.is_available():
        figures["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    record = {
        "benchmark": "recipe_run",
        "figures": figures,
        "config": {"configs": args.config, "overrides": args.overrides,
                   "parameters": sum(p.numel() for p in cli.model.policy.parameters())},
        "machine": {**machine_info(), **({"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {})},
        "scalars": series,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
