"""The training step's pass over the logits: sampled tokens' log-probs (forward and backward) and the
entropy, on SmolLM2-135M's vocabulary, before and after ``algos.selective_log_softmax_and_entropy``.

- ``autograd``: the code until 2026-12-07: ``gather(x) - logsumexp(x)`` on ``x = logits.float()`` in
  chunks of whole rows up to 16M logits, its backward left to autograd, and the entropy in a second
  pass (``log_softmax``, no gradient) over the same chunks;
- ``fused``: both in one pass, positions in cache-sized chunks (``algos.logprobs.CPU_CHUNK_LOGITS``),
  with its own backward.

Logits [rows, positions, 49152] (the GRPO step's 64 rows x 64 new tokens by default), float32 and
bfloat16, each candidate alternating within every round; a figure is the median over rounds of each
round's median call. Whether the two give the same bits (log-probs, entropies, gradients) is part of
the result.

    python -m benchmarks.logprob_pass --out benchmarks/results/real_model/logprob_pass_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SMOLLM2_VOCAB = 49152
OLD_CHUNK = 1 << 24  # logits per chunk before


def autograd_pass(logits, ids):
    """(log-probs, entropy) as computed before: autograd through gather - logsumexp, entropy apart."""
    import torch

    per_row = logits.shape[1] * logits.shape[2]
    rows = max(OLD_CHUNK // per_row, 1)
    logp, entropy = [], []
    for chunk, chunk_ids in zip(logits.split(rows), ids.split(rows)):
        x = chunk.float()
        logp.append(x.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1))
    with torch.no_grad():
        for chunk in logits.split(rows):
            log_p = torch.log_softmax(chunk.float(), dim=-1)
            entropy.append(-(log_p.exp() * log_p).sum(dim=-1))
    return torch.cat(logp), torch.cat(entropy)


def fused_pass(logits, ids):
    from r3lightning.algos import selective_log_softmax_and_entropy

    return selective_log_softmax_and_entropy(logits, ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=SMOLLM2_VOCAB)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, candidates alternating in each")
    parser.add_argument("--calls", type=int, default=3, help="timed calls per candidate and round")
    args = parser.parse_args()
    import torch

    from scripts.machine_info import machine_info

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    candidates = {"autograd": autograd_pass, "fused": fused_pass}
    figures: dict[str, object] = {}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        logits = (torch.randn(args.rows, args.positions, args.vocab) * 3).to(dtype)
        ids = torch.randint(0, args.vocab, (args.rows, args.positions))
        weights = torch.randn(args.rows, args.positions)

        def call(fn):
            leaf = logits.clone().requires_grad_()
            start = time.perf_counter()
            logp, entropy = fn(leaf, ids)
            middle = time.perf_counter()
            (logp * weights).sum().backward()
            end = time.perf_counter()
            return (logp.detach(), entropy, leaf.grad), middle - start, end - middle

        outputs = {name: call(fn)[0] for name, fn in candidates.items()}
        figures[f"{dtype_name}_same_bits"] = all(torch.equal(a, b) for a, b in zip(outputs["autograd"], outputs["fused"]))
        rounds = {name: {"forward": [], "backward": []} for name in candidates}
        for _ in range(args.repeats):
            for name, fn in candidates.items():
                calls = [call(fn)[1:] for _ in range(args.calls)]
                rounds[name]["forward"].append(statistics.median(c[0] for c in calls))
                rounds[name]["backward"].append(statistics.median(c[1] for c in calls))
        for name in candidates:
            for part in ("forward", "backward"):
                figures[f"{dtype_name}_{name}_{part}_s"] = round(statistics.median(rounds[name][part]), 4)
            totals = [f + b for f, b in zip(rounds[name]["forward"], rounds[name]["backward"])]
            figures[f"{dtype_name}_{name}_s"] = round(statistics.median(totals), 4)
            figures[f"{dtype_name}_{name}_s_rounds"] = [round(t, 4) for t in totals]
        figures[f"{dtype_name}_fused_over_autograd"] = round(figures[f"{dtype_name}_fused_s"] / figures[f"{dtype_name}_autograd_s"], 3)
        print(dtype_name, {k: v for k, v in figures.items() if k.startswith(dtype_name)}, flush=True)
    result = {
        "benchmark": "logprob_pass",
        "figures": figures,
        "config": {"rows": args.rows, "positions": args.positions, "vocab": args.vocab, "threads": args.threads,
                   "repeats": args.repeats, "calls": args.calls, "old_chunk_logits": OLD_CHUNK,
                   "statistic": "median over rounds of each round's median call; candidates alternate within a round"},
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
