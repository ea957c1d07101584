"""benchmarks/logprob_pass.py: both candidates run in both dtypes, give the same bits, and each ratio is
the one its medians give."""

import json
import sys

from benchmarks import logprob_pass


def test_small_logits_same_bits_and_consistent_ratios(tmp_path, monkeypatch):
    out = tmp_path / "pass.json"
    monkeypatch.setattr(sys, "argv", ["logprob_pass", "--out", str(out), "--rows", "3", "--positions", "5", "--vocab", "300",
                                      "--threads", "1", "--repeats", "2", "--calls", "2"])
    logprob_pass.main()
    record = json.loads(out.read_text())
    figures = record["figures"]
    assert record["benchmark"] == "logprob_pass" and record["config"]["vocab"] == 300
    for dtype in ("float32", "bfloat16"):
        assert figures[f"{dtype}_same_bits"] is True
        assert len(figures[f"{dtype}_fused_s_rounds"]) == 2
        ratio = figures[f"{dtype}_fused_s"] / figures[f"{dtype}_autograd_s"]
        assert abs(figures[f"{dtype}_fused_over_autograd"] - ratio) < 2e-3
