"""benchmarks/update_parts.py: the chosen pairs run at the asked completion length, and each ratio agrees
with the per-round figures it is computed from."""

import json
import statistics
import sys

from benchmarks import update_parts


def test_forward_pair_at_a_chosen_length_records_per_round_ratios(tmp_path, monkeypatch):
    out = tmp_path / "parts.json"
    monkeypatch.setattr(sys, "argv", ["update_parts", "--out", str(out), "--threads", "1", "--repeats", "2",
                                      "--calls", "3", "--parts", "forward", "--new_tokens", "12"])
    update_parts.main()
    record = json.loads(out.read_text())
    figures = record["figures"]
    assert record["config"]["new_tokens"] == 12
    assert {key for key in figures if key.endswith("_ms")} == {
        "forward_forward_backward_ms", "forward_forward_grad_ms", "forward_forward_no_grad_ms", "forward_reference_pass_ms"}
    base = figures["forward_forward_backward_ms_rounds"]
    for candidate in ("forward_grad", "forward_no_grad", "reference_pass"):
        rounds = figures[f"forward_{candidate}_ms_rounds"]
        assert len(rounds) == 2
        expected = statistics.median(c / b for c, b in zip(rounds, base))
        assert abs(figures[f"forward_{candidate}_over_forward_backward"] - expected) < 2e-3
