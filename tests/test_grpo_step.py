"""benchmarks/grpo_step.py's r3lightning worker: the train part split into its sub-parts."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_hf(tmp_path: Path, beta: float) -> list[dict]:
    out = tmp_path / "grpo_step.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.grpo_step", "--variants", "hf", "--repeats", "1", "--steps", "2",
         "--warmup", "1", "--threads", "1", "--new-tokens", "8", "--beta", str(beta), "--out", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=600,
    )
    return json.loads(out.read_text())["measurements"]["after"]["per_step"]["hf"][0]


def test_train_sub_parts_are_recorded_inside_train_with_a_kl_reference(tmp_path):
    steps = run_hf(tmp_path, 0.04)
    assert len(steps) == 2
    for step in steps:
        parts = [step[part] for part in ("reference", "loss", "backward", "update")]
        # The sub-parts are calls made inside optimize(): their sum cannot exceed it.
        assert all(seconds > 0 for seconds in parts) and sum(parts) <= step["train"]
