"""The trainer's attention at the SmolLM2 GRPO step's shapes, forward and backward of one layer, on the CPU:

- ``bfloat16``: what a ``bf16-mixed`` update ran before ``training/attention.py`` (autocast casts the
  inputs to bfloat16; transformers repeats each key/value head for its 3 query heads);
- ``float32``: the same in float32 (what a float32 update runs);
- ``float32_gqa``: float32 with the kernel's own grouped-query heads (``enable_gqa``; what
  ``training_sdpa`` runs under a CPU autocast);
- ``bfloat16_gqa``: bfloat16 with ``enable_gqa``.

Queries [64, 9, 65, 64] over keys and values [64, 3, 102, 64] (64 rows of 65 new columns after a shared
prompt of 37, SmolLM2's heads), a causal boolean mask with some padding. Rounds alternate the four;
a figure is the median over rounds of a round's mean call. Also whether the float32 grouped-query
result and its gradients equal the repeated-heads ones to the bit.

    python -m benchmarks.training_attention --out benchmarks/results/real_model/training_attention_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

ROWS, HEADS, KV_HEADS, NEW, COLUMNS, HEAD_DIM = 64, 9, 3, 65, 102, 64
VARIANTS = {"bfloat16": (torch.bfloat16, False), "float32": (torch.float32, False),
            "float32_gqa": (torch.float32, True), "bfloat16_gqa": (torch.bfloat16, True)}


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(ROWS, HEADS, NEW, HEAD_DIM, generator=generator)
    key, value = (torch.randn(ROWS, KV_HEADS, COLUMNS, HEAD_DIM, generator=generator) for _ in range(2))
    mask = torch.ones(ROWS, 1, NEW, COLUMNS, dtype=torch.bool).tril_(COLUMNS - NEW)
    mask[:5, ..., -3:] = False  # rows that ended early
    return query, key, value, mask


def attention(query, key, value, mask, dtype: torch.dtype, gqa: bool) -> list[torch.Tensor]:
    """Output and the gradients of query, key and value for a sum-of-squares loss."""
    query, key, value = (t.detach().to(dtype).requires_grad_() for t in (query, key, value))
    if gqa:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True)
    else:
        groups = HEADS // KV_HEADS
        repeat = lambda x: x[:, :, None].expand(ROWS, KV_HEADS, groups, COLUMNS, HEAD_DIM).reshape(ROWS, HEADS, COLUMNS, HEAD_DIM)
        out = F.scaled_dot_product_attention(query, repeat(key), repeat(value), attn_mask=mask, scale=HEAD_DIM**-0.5)
    out.float().square().sum().backward()
    return [out.detach(), query.grad, key.grad, value.grad]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/real_model/training_attention_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tensors = inputs()
    repeated, shared = attention(*tensors, torch.float32, False), attention(*tensors, torch.float32, True)
    same_bits = [bool(torch.equal(a, b)) for a, b in zip(repeated, shared)]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (dtype, gqa) in VARIANTS.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                attention(*tensors, dtype, gqa)
            times[name].append((time.perf_counter() - start) / args.calls * 1000)
    figures = {f"{name}_ms": round(statistics.median(values[1:]), 1) for name, values in times.items()}  # round 0 warms up
    figures.update({f"{name}_ms_rounds": [round(v, 1) for v in values] for name, values in times.items()})
    figures["float32_gqa_over_bfloat16"] = round(figures["float32_gqa_ms"] / figures["bfloat16_ms"], 3)
    figures["float32_gqa_over_float32"] = round(figures["float32_gqa_ms"] / figures["float32_ms"], 3)
    figures["gqa_same_bits_output_dquery_dkey_dvalue"] = same_bits
    from scripts.machine_info import machine_info

    report = {"benchmark": "training_attention", "figures": figures,
              "config": {"rows": ROWS, "heads": HEADS, "kv_heads": KV_HEADS, "new_columns": NEW, "columns": COLUMNS,
                         "head_dim": HEAD_DIM, **vars(args)}, "machine": machine_info()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in figures.items() if not k.endswith("rounds")}))


if __name__ == "__main__":
    main()
