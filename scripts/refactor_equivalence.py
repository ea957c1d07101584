"""Does a refactor change any number? Record the TensorBoard scalars of two short runs, or check them.

The two runs:

- ``arithmetic``: the first 20 steps of ``configs/examples/grpo_arithmetic_cpu.yaml`` with the warm-start
  shortened to 10 steps, so that 10 SFT and 10 GRPO steps are both covered;
- ``quickstart_rl``: 20 R³L steps of ``configs/examples/r3l_procedural_d1_cpu.yaml`` resumed from a saved 150-step warm-start
  checkpoint of the same recipe (reflections, retries, distillation, pivotal credit, amplification).

Every scalar except measurements of the machine (``time/``, ``perf/``, ``memory/``: wall clock and the
process's peak memory, which differ between two runs of one commit) is compared at every step, on both
sides; ``--check`` fails when any differs from the recorded file by more than ``--tol`` or a tag appears
or disappears.

    python -m scripts.refactor_equivalence --record /tmp/equivalence.json
    python -m scripts.refactor_equivalence --check /tmp/equivalence.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from scripts.machine_info import machine_info

MACHINE_PREFIXES = ("time/", "perf/", "memory/")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def _fit(args: list[str]):
    from r3lightning.cli.main import R3LightningCLI

    return R3LightningCLI(args=["fit", *args])


def read_scalars(log_dir: str, machine: bool = False) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard event files under ``log_dir``: tag -> [(step, value)]; the
    machine's measurements (``MACHINE_PREFIXES``) only with ``machine``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for root, _, files in os.walk(log_dir):
        if not any(f.startswith("events.out.tfevents") for f in files):
            continue
        accumulator = EventAccumulator(root, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if tag.startswith(MACHINE_PREFIXES) and not machine:
                continue
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: sorted(values) for tag, values in sorted(scalars.items())}


def run_arithmetic(work: str) -> dict:
    log = os.path.join(work, "arithmetic")
    _fit([
        "--config", "configs/examples/grpo_arithmetic_cpu.yaml",
        "--trainer.max_steps", "20", "--model.phases.warmstart.steps", "10",
        "--trainer.val_check_interval", "10",
        "--trainer.logger.class_path", "lightning.pytorch.loggers.TensorBoardLogger",
        "--trainer.logger.init_args.save_dir", log, "--trainer.logger.init_args.name", "run", *QUIET,
    ])
    return read_scalars(log)


def run_quickstart_rl(work: str, warm_steps: int = 150, rl_steps: int = 20) -> dict:
    common = [
        "--config", "configs/examples/r3l_procedural_d1_cpu.yaml", "--model.phases.warmstart.steps", str(warm_steps),
        "--trainer.val_check_interval", str(warm_steps), *QUIET,
    ]
    warm_log = os.path.join(work, "warm")
    cli = _fit([*common, "--trainer.max_steps", str(warm_steps), "--trainer.logger.init_args.save_dir", warm_log])
    checkpoint = os.path.join(work, "warm.ckpt")
    cli.trainer.save_checkpoint(checkpoint)
    rl_log = os.path.join(work, "rl")
    _fit([
        *common, "--trainer.max_steps", str(warm_steps + rl_steps),
        "--trainer.logger.init_args.save_dir", rl_log, "--ckpt_path", checkpoint,
    ])
    return read_scalars(rl_log)


def compare(recorded: dict, measured: dict, tol: float) -> list[str]:
    problems = []
    for tag in sorted(set(recorded) | set(measured)):
        if tag not in measured:
            problems.append(f"{tag}: recorded but no longer logged")
            continue
        if tag not in recorded:
            problems.append(f"{tag}: newly logged")
            continue
        old, new = dict(map(tuple, recorded[tag])), dict(map(tuple, measured[tag]))
        for step in sorted(set(old) | set(new)):
            a, b = old.get(step), new.get(step)
            if a is None or b is None:
                problems.append(f"{tag} step {step}: {a} vs {b}")
            elif not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol):
                problems.append(f"{tag} step {step}: {a!r} vs {b!r} (|diff| {abs(a - b):.3g})")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", help="write the measured scalars to this JSON file")
    mode.add_argument("--check", help="compare the measured scalars with this JSON file")
    parser.add_argument("--tol", type=float, default=1e-6)
    parser.add_argument("--runs", nargs="+", default=["arithmetic", "quickstart_rl"])
    args = parser.parse_args()
    os.chdir(ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)  # bit-reproducibility needs the same thread count on both sides
    runners = {"arithmetic": run_arithmetic, "quickstart_rl": run_quickstart_rl}
    measured = {}
    with tempfile.TemporaryDirectory() as work:
        for name in args.runs:
            measured[name] = runners[name](os.path.join(work, name))
    if args.record:
        result = {
            "benchmark": "refactor_equivalence",
            "figures": measured,
            "config": {"runs": args.runs, "threads": 1, "excluded_prefixes": list(MACHINE_PREFIXES)},
            "machine": machine_info(),
        }
        Path(args.record).write_text(json.dumps(result, indent=1) + "\n")
        print(f"recorded {sum(len(v) for v in measured.values())} tags to {args.record}")
        return
    recorded = {
        name: {tag: values for tag, values in run.items() if not tag.startswith(MACHINE_PREFIXES)}
        for name, run in json.loads(Path(args.check).read_text())["figures"].items()
    }
    problems = []
    for name in args.runs:
        problems += [f"{name}: {p}" for p in compare(recorded[name], measured[name], args.tol)]
    tags = sum(len(measured[n]) for n in args.runs)
    values = sum(len(v) for n in args.runs for v in measured[n].values())
    if problems:
        print(f"{len(problems)} differences over {tags} tags / {values} values:")
        print("\n".join(problems[:50]))
        raise SystemExit(1)
    print(f"identical within {args.tol:g}: {tags} tags, {values} values")


if __name__ == "__main__":
    main()
