"""How close the eager decoding step can come to its FLOP limit: a lower bound from its two parts.

    python -m benchmarks.decode_floor --out benchmarks/results/decode_floor_cpu.json

On the GRPO benchmark's model (``grpo_step.write_model``: 4 layers, hidden 256, vocabulary 860) one eager
decoding step (``FusedDecoder.step``, the default engine's) is timed at the rollout's 64 rows and at 1
row, and so are its 17 matmuls alone, replayed back to back on the decoder's own weights with the
step's calls (``F.linear`` / ``addmm``) and shapes. A step's operations run one after another, each
dispatched and then its kernel run (on every thread where it parallelizes) while the caller waits,
so the two costs add:

- ``fixed`` = step at 1 row - matmuls at 1 row: dispatch, Python and the non-matmul kernels at 1
  row (all of which a 64-row step also pays, and more);
- ``floor`` = matmuls at 64 rows + ``fixed``: no eager step with these operations can be faster;
- ``limit`` = the step's matmul FLOPs (2 x matmul parameters x 64) at the square-matrix rate
  (2048 x 2048, ``rollout_throughput.matmul_rate``, measured in every repeat): the yardstick of
  issue 39's goal for the rollout (at most 2.5x its FLOP limit).

Repeats interleave the four timings and the rate, so drift hits all alike; the figures are medians of
the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.fused_step_ab import STEPS, decode
from scripts.machine_info import machine_info


def step_matmuls(decoder, rows: int):
    """A function running one decoding step's matmuls in its order and calls: per layer the fused
    query/key/value projection, the output projection added to the residual, the fused gate/up
    projection and the down projection added to the residual; then the LM head."""
    import torch

    hidden = decoder.model.config.hidden_size
    x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
    attended = torch.randn(rows, decoder.heads * decoder.head_dim)
    activated = torch.randn(rows, decoder.intermediate)
    layers = list(zip(decoder.decoder.layers, decoder._weights))

    def run() -> None:
        for _, fused in layers:
            fused.qkv(x)
            fused.out.add_to(residual, attended)
            fused.gate_up(x)
            fused.down.add_to(residual, activated)
        decoder._lm_head(x)

    return run


def seconds_per_call(run, calls: int = STEPS) -> float:
    run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", type=float, default=2.5, help="the goal, as a multiple of the FLOP limit")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.grpo_step import write_model
    from benchmarks.rollout_throughput import decode_step_flops, matmul_rate
    from r3lightning.engines.hf.fused_step import FusedDecoder

    torch.set_num_threads(args.threads)
    directory = Path(tempfile.mkdtemp(prefix="decode-floor-"))
    write_model(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    decoder = FusedDecoder(model)
    decoder.refresh(("benchmark",))
    flops = decode_step_flops(model, 64, context=0)  # the matmuls only, as the limit counts them
    per_repeat: list[dict] = []
    with torch.no_grad():
        for _ in range(args.repeats):
            rate = matmul_rate(torch.float32, "cpu")["flops_per_s"]
            step64, step1 = decode(decoder, 64)[0], decode(decoder, 1)[0]
            matmuls64, matmuls1 = seconds_per_call(step_matmuls(decoder, 64)), seconds_per_call(step_matmuls(decoder, 1))
            limit, fixed = flops / rate, step1 - matmuls1
            per_repeat.append({
                "square_gflops": round(rate / 1e9, 1), "limit_ms": round(limit * 1e3, 3),
                "step64_ms": round(step64 * 1e3, 3), "step1_ms": round(step1 * 1e3, 3),
                "matmuls64_ms": round(matmuls64 * 1e3, 3), "matmuls1_ms": round(matmuls1 * 1e3, 3),
                "step64_over_limit": round(step64 / limit, 3), "matmuls64_over_limit": round(matmuls64 / limit, 3),
                "fixed_over_limit": round(fixed / limit, 3), "floor_over_limit": round((matmuls64 + fixed) / limit, 3),
            })
            print(json.dumps(per_repeat[-1]), flush=True)
    keys = [k for k in per_repeat[0] if k.endswith("_over_limit") or k.endswith("_ms") or k == "square_gflops"]
    figures = {f"{k}_median": round(statistics.median(r[k] for r in per_repeat), 3) for k in keys}
    floors = [r["floor_over_limit"] for r in per_repeat]
    figures["floor_over_limit_quartiles"] = [round(q, 3) for q in statistics.quantiles(floors, n=4)]
    figures["repeats_with_floor_above_target"] = sum(f > args.target for f in floors)
    result = {"benchmark": "decode_floor", "figures": figures, "per_repeat": per_repeat,
              "config": {"rows": 64, "steps": STEPS, "threads": args.threads, "repeats": args.repeats, "target": args.target,
                         "step_matmul_gflop": round(flops / 1e9, 4)},
              "machine": machine_info()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
