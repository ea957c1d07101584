"""A comparison run two ways: its wall time each way, and whether every run logged the same numbers.

``run`` times one way of running ``experiments.compare_algorithms`` (a checkout's Python, its
arguments, its environment) into ``<work>/<side>/``; ``report`` reads two such sides and writes the
benchmark JSON: each side's wall time and the ratio, each arm's summed run time, and, run by run
(warm-starts and every arm of every seed), whether every scalar it logged to TensorBoard is equal
step for step, leaving out the tags that measure the machine (wall times, throughput, memory).

Runs are deterministic per torch thread count on one machine, so two schedules of the same runs at
the same thread count must log identical numbers; a difference means the schedule leaked state from
one run into another.

    python -m benchmarks.comparison_speed run --side before --python /work/wt-before/.venv/bin/python \\
        --cwd /work/wt-before --work /tmp/speed --env OMP_NUM_THREADS=1 -- --recipe R --seeds 0 1 2 3 4 \\
        --workers 1 --threads 1
    python -m benchmarks.comparison_speed run --side after --work /tmp/speed -- --recipe R --seeds 0 1 2 3 4
    python -m benchmarks.comparison_speed report --work /tmp/speed --out benchmarks/results/comparison_speed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts.machine_info import machine_info
from benchmarks.recipe_run import scalars

MACHINE_TAG_PREFIXES = ("time/", "memory/")
"""Tags that measure the machine, not the run: they differ between two identical runs."""


def measures_the_machine(tag: str) -> bool:
    """Wall times, throughputs (``*_per_s``, ``perf/*_s``) and memory."""
    return tag.startswith(MACHINE_TAG_PREFIXES) or tag.endswith("_per_s") or (tag.startswith("perf/") and tag.endswith("_s"))


def run_side(side: str, python: str, cwd: str, work: Path, env: list[str], compare_args: list[str]) -> dict:
    """Run ``python -m experiments.compare_algorithms`` in ``cwd`` with ``compare_args``, its output in
    ``work/side``; write and return the timing record."""
    out_dir = work / side
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [python, "-m", "experiments.compare_algorithms", *compare_args, "--out", str(out_dir / "compare.json")]
    extra = dict(item.split("=", 1) for item in env)
    start = time.perf_counter()
    with open(out_dir / "log", "w") as log:
        subprocess.run(command, cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", **extra}, stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    timing = {"side": side, "command": command, "cwd": cwd, "env": extra, "wall_s": time.perf_counter() - start}
    (out_dir / "timing.json").write_text(json.dumps(timing, indent=2))
    return timing


def run_logs(side_dir: Path) -> dict[str, str]:
    """Each run's TensorBoard directory under a side's ``compare_runs``, by run name (its only version)."""
    logs = {}
    for run in sorted((side_dir / "compare_runs").iterdir()):
        if run.is_dir():
            [version] = sorted(run.glob("version_*"))
            logs[run.name] = str(version)
    return logs


def scalar_differences(first: str, second: str) -> dict:
    """Tags (machine measures left out) that two runs' logs do not share, or whose (step, value)
    series differ: the first differing point of each."""
    a = {t: v for t, v in scalars(first).items() if not measures_the_machine(t)}
    b = {t: v for t, v in scalars(second).items() if not measures_the_machine(t)}
    differing = {}
    for tag in sorted(set(a) | set(b)):
        if tag not in a or tag not in b:
            differing[tag] = "logged by one run only"
        elif a[tag] != b[tag]:
            differing[tag] = next(({"step": x[0], "values": [x[1], y[1]]} for x, y in zip(a[tag], b[tag]) if x != y),
                                  {"points": [len(a[tag]), len(b[tag])]})
    return {"tags_compared": len(set(a) & set(b)), "points_compared": sum(len(a[t]) for t in set(a) & set(b)),
            "differing": differing}


def report(work: Path, out: str, first: str, second: str) -> dict:
    sides = {side: json.loads((work / side / "timing.json").read_text()) for side in (first, second)}
    records = {side: json.loads((work / side / "compare.json").read_text()) for side in sides}
    logs = {side: run_logs(work / side) for side in sides}
    if set(logs[first]) != set(logs[second]):
        raise SystemExit(f"{work}: the two sides ran different runs: {sorted(set(logs[first]) ^ set(logs[second]))}")
    equality = {name: scalar_differences(logs[first][name], logs[second][name]) for name in logs[first]}

    def arm_seconds(record: dict) -> dict[str, float]:
        return {m: round(sum(run["wall_s"] for run in runs.values()), 1) for m, runs in record["per_seed"].items()}

    figures = {
        f"{first}_wall_s": round(sides[first]["wall_s"], 1),
        f"{second}_wall_s": round(sides[second]["wall_s"], 1),
        f"{second}_over_{first}_wall": round(sides[second]["wall_s"] / sides[first]["wall_s"], 3),
        f"{first}_run_seconds_by_arm": arm_seconds(records[first]),
        f"{second}_run_seconds_by_arm": arm_seconds(records[second]),
        f"{first}_warmstart_seconds": round(sum(w.get("wall_s", 0.0) for w in records[first]["warm_start"].values()), 1),
        f"{second}_warmstart_seconds": round(sum(w.get("wall_s", 0.0) for w in records[second]["warm_start"].values()), 1),
        "runs_compared": len(equality),
        "runs_with_identical_scalars": sum(not e["differing"] for e in equality.values()),
        "scalar_points_compared": sum(e["points_compared"] for e in equality.values()),
        "refused_runs": {side: records[side]["figures"].get("refused_runs", {}) for side in sides},
    }
    result = {
        "benchmark": "comparison_speed",
        "figures": figures,
        "per_run_equality": equality,
        "config": {"sides": sides, "left_out_tags": "time/*, memory/*, *_per_s, perf/*_s",
                   "compare_config": records[second]["config"]},
        "machine": machine_info(),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="time one side")
    run.add_argument("--side", required=True)
    run.add_argument("--work", required=True, type=Path)
    run.add_argument("--python", default=sys.executable, help="the interpreter of the checkout to run")
    run.add_argument("--cwd", default=str(Path(__file__).resolve().parents[1]), help="the checkout to run")
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("compare_args", nargs=argparse.REMAINDER, help="after --: compare_algorithms' arguments (no --out)")
    rep = commands.add_parser("report", help="compare two sides")
    rep.add_argument("--work", required=True, type=Path)
    rep.add_argument("--out", required=True)
    rep.add_argument("--sides", nargs=2, default=["before", "after"])
    args = parser.parse_args()
    if args.command == "run":
        compare_args = args.compare_args[1:] if args.compare_args[:1] == ["--"] else args.compare_args
        print(json.dumps(run_side(args.side, args.python, args.cwd, args.work, args.env, compare_args)))
    else:
        print(json.dumps(report(args.work, args.out, *args.sides)["figures"], indent=2))


if __name__ == "__main__":
    main()
