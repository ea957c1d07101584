"""Gather named TensorBoard scalars of a comparison's runs into one JSON: per run, per tag, the mean
over its logged steps, the first and last three values and their count.

A comparison's JSON keeps only the figures its summary names; this reads any tag back from the runs'
logs (``compare_runs/<arm>_seed<S>/version_<N>``, the newest version of each run; warm-starts skipped).

    python -m scripts.gather_scalars benchmarks/results/r3l_d2_ws600half/compare_runs \\
        --tags rollout/clean_success_share rollout/success_label_accuracy --out labels_tb.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from scripts.refactor_equivalence import read_scalars


def newest_versions(runs_dir: str) -> dict[str, str]:
    """run name -> its newest ``version_<N>`` folder, for every run folder under ``runs_dir`` but the
    warm-starts'."""
    runs = {}
    for run in sorted(Path(runs_dir).iterdir()):
        versions = [v for v in run.glob("version_*") if v.is_dir()] if run.is_dir() else []
        if versions and not run.name.startswith("warmstart"):
            runs[run.name] = str(max(versions, key=lambda v: int(v.name.split("_")[1])))
    return runs


def summarize(values: list[float]) -> dict:
    """Mean, first three, last three and count of one tag's values (in step order)."""
    return {"mean": sum(values) / len(values), "first3": values[:3], "last3": values[-3:], "n": len(values)}


def gather(runs_dir: str, tags: list[str]) -> dict[str, dict[str, dict]]:
    """run name -> tag -> ``summarize`` of its values; a tag a run never logged is left out."""
    figures = {}
    for name, version in newest_versions(runs_dir).items():
        scalars = read_scalars(version)
        figures[name] = {tag: summarize([v for _, v in scalars[tag]]) for tag in tags if scalars.get(tag)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", help="a comparison's compare_runs/ folder")
    parser.add_argument("--tags", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not os.path.isdir(args.runs_dir):
        raise SystemExit(f"gather_scalars: {args.runs_dir} is not a folder")
    result = {
        "benchmark": "gather_scalars",
        "figures": gather(args.runs_dir, args.tags),
        "config": {"runs_dir": args.runs_dir, "tags": args.tags},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
