"""ReflectRL's CPU example end to end, timed: the expert, the GNT pool, the stage-1 SFT file, stages 1 and 2.

Runs the four commands of configs/examples/reflectrl_arithmetic_cpu.yaml's header, each in its own
``r3l`` process, with every path moved under ``--work`` (the YAMLs are copied there with the paths
rewritten), and records wall and CPU time per stage, the expert's accuracy, the pool's and SFT file's
figures and the student's validation success in stage 1 (reflective, GNT in context; and direct, at
the switch) and stage 2 (direct).

    nice -n 19 python -m experiments.reflectrl_example --out benchmarks/results/reflectrl_example_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

from scripts.machine_info import machine_info

EXPERT_YAML = ROOT / "configs" / "examples" / "reflectrl_expert_arithmetic_cpu.yaml"
STUDENT_YAML = ROOT / "configs" / "examples" / "reflectrl_arithmetic_cpu.yaml"
R3L = [sys.executable, "-c", "from r3lightning.cli.main import main; main()"]


def rewrite_configs(work: Path) -> tuple[Path, Path, dict]:
    """Copies of the example YAMLs writing under ``work``; returns (expert yaml, student yaml, paths)."""
    paths = {"expert": work / "expert.ckpt", "pool": work / "pool.jsonl", "sft": work / "sft.jsonl", "logs": work / "logs"}
    expert = yaml.safe_load(EXPERT_YAML.read_text())
    expert["trainer"]["logger"]["init_args"]["save_dir"] = str(paths["logs"])
    [checkpoint] = expert["trainer"]["callbacks"]
    checkpoint["init_args"]["dirpath"] = str(work)
    student = yaml.safe_load(STUDENT_YAML.read_text())
    student["trainer"]["logger"]["init_args"]["save_dir"] = str(paths["logs"])
    student["data"]["suite"]["init_args"]["pool"] = str(paths["pool"])
    student["model"]["phases"]["warmstart"]["demos"]["source"] = str(paths["sft"])
    expert_path, student_path = work / "expert.yaml", work / "student.yaml"
    expert_path.write_text(yaml.safe_dump(expert, sort_keys=False))
    student_path.write_text(yaml.safe_dump(student, sort_keys=False))
    return expert_path, student_path, paths


def header_arguments(command: str) -> list[str]:
    """The extra arguments the student YAML's header gives ``r3l <command>`` (so the two never drift)."""
    text = STUDENT_YAML.read_text().split("\nseed_everything")[0]
    lines = [line.lstrip("#").strip() for line in text.splitlines()]
    joined = " ".join(lines).replace("\\ ", " ")
    start = joined.index(f"r3l {command} ")
    words = joined[start:].split()[2:]
    out, skip = [], False
    for word in words:
        if word.startswith("#") or word == "r3l":
            break
        if skip:
            skip = False
            continue
        if word in ("--config", "--expert", "--pool", "--out"):
            skip = True  # the paths are this script's
            continue
        out.append(word)
    return out


def run(name: str, args: list[str], log: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w") as handle:
        done = subprocess.run([*R3L, *args], stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}); see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{name}: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/reflectrl_example_cpu.json")
    parser.add_argument("--work", default="runs/reflectrl_example", help="scratch directory (replaced)")
    args = parser.parse_args()
    work = (ROOT / args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    expert_yaml, student_yaml, paths = rewrite_configs(work)
    pool_args = header_arguments("gnt-pool")
    sft_args = header_arguments("reflect-sft")
    timings = {}
    timings["0_expert"] = run("expert", ["fit", "--config", str(expert_yaml), "--trainer.enable_progress_bar", "false"], work / "expert.log")
    timings["1_gnt_pool"] = run("gnt-pool", ["gnt-pool", "--config", str(student_yaml), "--expert", str(paths["expert"]),
                                             *pool_args, "--out", str(paths["pool"])], work / "pool.log")
    timings["2_reflect_sft"] = run("reflect-sft", ["reflect-sft", "--config", str(student_yaml), "--pool", str(paths["pool"]),
                                                   *sft_args, "--out", str(paths["sft"])], work / "sft.log")
    # Strict: a stage whose switched-on component never acted (a teacher identical to its student) stops the example.
    timings["3_student"] = run("student", ["fit", "--config", str(student_yaml), "--trainer.enable_progress_bar", "false",
                                           "--health.strict", "true"], work / "student.log")
    total = {k: round(sum(t[k] for t in timings.values()), 1) for k in ("wall_s", "cpu_s")}

    expert_report = json.loads((paths["logs"] / "reflectrl_expert" / "version_0" / "phase_report.json").read_text())
    pool = json.loads(Path(f"{paths['pool']}.summary.json").read_text())
    sft = json.loads(Path(f"{paths['sft']}.summary.json").read_text())
    student = json.loads((paths["logs"] / "reflectrl" / "version_0" / "reflectrl_report.json").read_text())
    stage1 = [r for r in student["records"] if r["stage"] == 1][-1]
    stage2 = [r for r in student["records"] if r["stage"] == 2][-1]
    figures = {
        "expert_val_greedy": expert_report["final"]["val/success_rate_greedy"],
        "expert_val_sampled": expert_report["final"]["val/success_rate"],
        **{k: v for k, v in pool.items() if k != "config"},
        **{k: v for k, v in sft.items() if k != "config"},
        "stage1_reflective_greedy": stage1["val/success_rate_greedy"],
        "stage1_reflective_sampled": stage1["val/success_rate"],
        "stage1_direct_greedy": stage1.get("val_direct/success_rate_greedy"),
        "stage1_direct_sampled": stage1.get("val_direct/success_rate"),
        "stage2_direct_greedy": stage2["val/success_rate_greedy"],
        "stage2_direct_sampled": stage2["val/success_rate"],
        "stage2_direct_response_len_greedy": stage2.get("val/response_len_greedy"),
        "student_records": student["records"],
        "timings": timings,
        "total": total,
    }
    result = {
        "benchmark": "reflectrl_example",
        "figures": figures,
        "config": {"expert_yaml": yaml.safe_load(expert_yaml.read_text()), "student_yaml": yaml.safe_load(student_yaml.read_text()),
                   "gnt_pool_args": pool_args, "reflect_sft_args": sft_args},
        "machine": machine_info(),
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in figures.items() if k not in ("student_records",)}, indent=2))


if __name__ == "__main__":
    main()
