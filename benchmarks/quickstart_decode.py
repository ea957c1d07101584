"""Should ``engine.hf_decode: auto`` pick ``fused_compiled`` on the CPU? The README's quickstart run whole,
with each decoding path, interleaved.

    python -m benchmarks.quickstart_decode --out benchmarks/results/quickstart_decode_cpu.json --repeats 2

Each repeat runs the quickstart command (``r3l fit --config configs/examples/r3l_procedural_d1_cpu.yaml``) three times, in
this order: ``fused_compiled`` on a new, empty inductor cache directory (``cold``: a user's first run),
``fused`` (today's ``auto`` on the CPU), and ``fused_compiled`` again on the directory the first run
filled (``warm``: every later run of the same shapes and code). Reported per run: the wall time of the
whole command (start-up, 210 warm-start steps, 30 RL steps, two validations), the sum over RL steps of
``time/rollout_s``, the seconds the engine spent in calls that compiled (``perf/hf_fused_compile_s``,
its last logged value), the graphs compiled, and the validation figures (the two paths decode to float
rounding of each other, so the success figures may differ by a few episodes); then per repeat the ratios
compiled / fused of the wall time and of the RL phase's rollout time. The machine runs nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.machine_info import machine_info
from benchmarks.recipe_run import scalars

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/examples/r3l_procedural_d1_cpu.yaml"
ORDER = (("compiled_cold", "fused_compiled"), ("fused", "fused"), ("compiled_warm", "fused_compiled"))


def last(series: dict, tag: str) -> float | None:
    return series[tag][-1][1] if series.get(tag) else None


def run_once(decode: str, name: str, log_dir: Path, cache_dir: Path, threads: int, r3l: str) -> dict:
    """One quickstart run with ``engine.hf_decode`` = ``decode``; its wall time and logged figures."""
    command = [r3l, "fit", "--config", CONFIG, "--model.engine.hf_decode", decode, "--model.engine.compile_cache_dir", str(cache_dir),
               "--trainer.logger.init_args.save_dir", str(log_dir), "--trainer.logger.init_args.name", name,
               "--trainer.enable_progress_bar", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: r3l fit failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    series = scalars(str(log_dir / name / "version_0"))
    rl_rollout = [value for step, value in series.get("time/rollout_s", [])]
    return {
        "decode": decode, "wall_s": round(wall, 1), "rl_rollout_s_total": round(sum(rl_rollout), 2), "rl_steps": len(rl_rollout),
        "compile_s": last(series, "perf/hf_fused_compile_s"), "graphs": last(series, "perf/hf_fused_compile_graphs"),
        "compile_skipped_calls": last(series, "perf/hf_fused_compile_skipped"),
        "cache_hits": last(series, "perf/compile_cache_hits"), "cache_misses": last(series, "perf/compile_cache_misses"),
        "val_greedy": [value for _, value in series.get("val/success_rate_greedy", [])],
        "val_sampled": [value for _, value in series.get("val/success_rate", [])],
    }


def ratios(runs: list[dict]) -> dict:
    """Per repeat and as medians, the compiled runs' wall time and RL rollout time over the fused run's
    of the same repeat (``runs``: ``run_once`` records with their ``repeat`` and ``run`` label)."""
    by = {(r["repeat"], r["run"]): r for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    figures: dict = {}
    for label in ("compiled_cold", "compiled_warm"):
        for figure, key in (("wall", "wall_s"), ("rl_rollout", "rl_rollout_s_total")):
            per_repeat = [by[(r, label)][key] / by[(r, "fused")][key] for r in repeats]
            figures[f"{label}_over_fused_{figure}_per_repeat"] = [round(x, 3) for x in per_repeat]
            figures[f"{label}_over_fused_{figure}_median"] = round(statistics.median(per_repeat), 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON to write")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every run (the README's command runs at the machine's cores)")
    parser.add_argument("--work", default="", help="where the runs' logs and caches go (default: a temporary directory)")
    args = parser.parse_args()

    r3l = str(Path(sys.executable).with_name("r3l"))
    work = Path(args.work or tempfile.mkdtemp(prefix="quickstart-decode-"))
    runs: list[dict] = []
    for repeat in range(args.repeats):
        cache_dir = work / f"inductor_cache_{repeat}"
        shutil.rmtree(cache_dir, ignore_errors=True)
        for label, decode in ORDER:
            record = {"repeat": repeat, "run": label, **run_once(decode, f"{label}_{repeat}", work / "logs", cache_dir, args.threads, r3l)}
            runs.append(record)
            print(json.dumps(record), flush=True)

    figures = {"runs": runs, **ratios(runs)}
    result = {
        "benchmark": "quickstart_decode",
        "figures": figures,
        "config": {"command": f"r3l fit --config {CONFIG} --model.engine.hf_decode <decode> --model.engine.compile_cache_dir <dir>",
                   "order_per_repeat": [label for label, _ in ORDER], "repeats": args.repeats, "threads": args.threads},
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in figures.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
