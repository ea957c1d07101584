"""The compiled fused decoding step's first call, with inductor's on-disk cache empty and warm.

    python -m benchmarks.compile_cache --out benchmarks/results/compile_cache_cpu.json

Each repeat runs two fresh processes on one new cache directory: the first finds it empty and
compiles (``cold``), the second finds what the first stored (``warm``: a later run of the same
shapes and code). Each process builds the GRPO benchmark's policy shape (``cpu-5m`` of
``rollout_throughput``: a 5M random-init Qwen2, float32), an ``HFEngine(decode="fused_compiled")``, and
times two ``generate`` calls of 64 prompts x 32 sampled tokens: the first compiles (or loads), the
second is the steady state. Reported: per repeat and as medians, the first call's seconds, the
seconds of the call that compiled as the engine logs them (``perf/hf_fused_compile_s``), the steady
call, the process's import and set-up time, and inductor's cache hits and misses; the ratio warm /
cold of the first call, and how many steady calls the first call's extra time equals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS, PROMPT_TOKENS, NEW_TOKENS = 64, 22, 32


def worker(threads: int) -> dict:
    """One process's figures (its cache directory comes from ``TORCHINDUCTOR_CACHE_DIR``)."""
    start = time.perf_counter()
    import torch

    from benchmarks.rollout_throughput import build_model, make_prompts
    from r3lightning.engines.base import SamplingParams
    from r3lightning.engines.hf.engine import HFEngine
    from r3lightning.training.models import build_tokenizer

    torch.set_num_threads(threads)
    corpus = [f"What is {a} + {b}? The answer is \\boxed{{{a + b}}}." for a in range(60) for b in range(0, 60, 7)]
    tokenizer = build_tokenizer(corpus, 1024)
    engine = HFEngine(build_model("cpu-5m", tokenizer, "float32", "cpu"), tokenizer, max_batch_size=ROWS,
                      prefix_cache=False, decode="fused_compiled", compile_cache_dir=os.environ["TORCHINDUCTOR_CACHE_DIR"])
    prompts, params = make_prompts(tokenizer, ROWS, PROMPT_TOKENS, 0), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0)
    calls = []
    ready = time.perf_counter()
    for _ in range(2):
        torch.manual_seed(0)
        begin = time.perf_counter()
        engine.generate(prompts, params)
        calls.append(time.perf_counter() - begin)
    metrics = engine.metrics()
    return {
        "setup_s": ready - start, "first_call_s": calls[0], "steady_call_s": calls[1],
        "compile_s": metrics["perf/hf_fused_compile_s"],
        "cache_hits": metrics["perf/compile_cache_hits"], "cache_misses": metrics["perf/compile_cache_misses"],
    }


def run_worker(cache_dir: str, threads: int) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_cache", "--worker", "--threads", str(threads)],
                          env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/compile_cache_cpu.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.threads)))
        return
    runs = {"cold": [], "warm": []}
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache_dir:
            for kind in ("cold", "warm"):
                runs[kind].append(run_worker(cache_dir, args.threads))
                print(f"repeat {repeat} {kind}: {json.dumps(runs[kind][-1])}", flush=True)
    figures = {}
    for kind, results in runs.items():
        for key in ("first_call_s", "compile_s", "steady_call_s", "setup_s", "cache_hits", "cache_misses"):
            figures[f"{kind}_{key}_per_repeat"] = [round(r[key], 3) for r in results]
            figures[f"{kind}_{key}_median"] = round(statistics.median(r[key] for r in results), 3)
    figures["warm_over_cold_first_call_per_repeat"] = [
        round(w["first_call_s"] / c["first_call_s"], 3) for w, c in zip(runs["warm"], runs["cold"])]
    figures["warm_over_cold_first_call_median"] = statistics.median(figures["warm_over_cold_first_call_per_repeat"])
    for kind in ("cold", "warm"):
        figures[f"{kind}_first_call_extra_in_steady_calls_median"] = round(statistics.median(
            (r["first_call_s"] - r["steady_call_s"]) / r["steady_call_s"] for r in runs[kind]), 1)
    from scripts.machine_info import machine_info

    record = {
        "benchmark": "compile_cache",
        "figures": figures,
        "config": {"model": "cpu-5m (rollout_throughput)", "rows": ROWS, "prompt_tokens": PROMPT_TOKENS,
                   "new_tokens": NEW_TOKENS, "decode": "fused_compiled", "threads": args.threads, "repeats": args.repeats,
                   "statistic": "per repeat: one cold then one warm process on a fresh cache directory; medians over repeats"},
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
