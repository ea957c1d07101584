"""The eager fused decoding step of this checkout against an older ``fused_step.py``, interleaved in one
process, with a check that both give the same logits to the bit.

    git show 01d44d9:r3lightning/engines/hf/fused_step.py > /tmp/fused_step_before.py
    python -m benchmarks.fused_step_ab --before /tmp/fused_step_before.py --out benchmarks/results/fused_step_ab_cpu.json

The GRPO benchmark's model (``grpo_step.write_model``: 4 layers, hidden 256), a prefill of 20 columns,
then 32 decoding steps (``FusedDecoder.step``, greedy), per repeat once with each version; the
per-step time of each, at the rollout's 64 rows and at 1 row (where the matmuls are negligible and a
step is its fixed cost: dispatch and Python). Reported: medians over repeats and the median of the
per-repeat ratios new / before.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.machine_info import machine_info

WIDTH, STEPS = 20, 32


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("fused_step_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def decode(decoder, rows: int):
    """Seconds per decoding step and the logits [STEPS + 1, rows, V] of a greedy run from a fixed prompt."""
    import torch

    from r3lightning.engines.hf.kv_cache import growing_cache

    cache = growing_cache(WIDTH + STEPS)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 800, (rows, WIDTH), generator=generator)
    logits = decoder.prefill(ids, torch.arange(WIDTH)[None].expand(rows, WIDTH), cache, torch.ones(rows, WIDTH, dtype=torch.long))
    mask, outputs = torch.zeros(rows, 1, 1, WIDTH + STEPS), [logits]
    start = time.perf_counter()
    for step in range(STEPS):
        logits = decoder.step(logits.argmax(-1), torch.full((rows,), WIDTH + step), cache, mask[..., : WIDTH + step + 1])
        outputs.append(logits)
    return (time.perf_counter() - start) / STEPS, torch.stack(outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="an older r3lightning/engines/hf/fused_step.py")
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 1])
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.grpo_step import write_model
    from r3lightning.engines.hf import fused_step

    torch.set_num_threads(args.threads)
    directory = Path(tempfile.mkdtemp(prefix="fused-step-ab-"))
    write_model(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    decoders = {"before": load_module(args.before).FusedDecoder(model), "new": fused_step.FusedDecoder(model)}
    for decoder in decoders.values():
        decoder.refresh(("benchmark",))
    figures = {}
    with torch.no_grad():
        for rows in args.rows:
            times = {name: [] for name in decoders}
            for _ in range(args.repeats):
                logits = {}
                for name, decoder in decoders.items():
                    seconds, logits[name] = decode(decoder, rows)
                    times[name].append(seconds)
                if not torch.equal(logits["before"], logits["new"]):
                    raise SystemExit(f"rows {rows}: the two versions' logits differ")
            ratios = [new / before for new, before in zip(times["new"], times["before"])]
            figures[f"rows{rows}"] = {
                "before_step_us_median": round(statistics.median(times["before"]) * 1e6, 1),
                "new_step_us_median": round(statistics.median(times["new"]) * 1e6, 1),
                "new_over_before_median_of_ratios": round(statistics.median(ratios), 3),
                "ratios_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
                "logits_identical": True,
            }
    result = {"benchmark": "fused_step_ab", "figures": figures,
              "config": {"before": args.before, "repeats": args.repeats, "threads": args.threads, "prefill_width": WIDTH, "steps": STEPS},
              "machine": machine_info()}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
