"""benchmarks/training_attention.py runs and writes its JSON (figures, config, machine)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_training_attention_benchmark_writes_every_variant_and_the_bit_check(tmp_path):
    out = tmp_path / "attention.json"
    subprocess.run([sys.executable, "-m", "benchmarks.training_attention", "--rounds", "2", "--calls", "1", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "training_attention" and {"config", "machine"} <= report.keys()
    figures = report["figures"]
    assert all(figures[f"{name}_ms"] > 0 for name in ("bfloat16", "float32", "float32_gqa", "bfloat16_gqa"))
    assert figures["gqa_same_bits_output_dquery_dkey_dvalue"][:2] == [True, True]  # queries' side: the same kernel math
