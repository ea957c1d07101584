"""The training update's small parts, each against the alternative a profile suggests, on the GRPO
benchmark's policy and batch (``benchmarks/grpo_step.py``: 3.0M-parameter Qwen2, 64 rows, 22 prompt +
32 new tokens by default, vocabulary 860), float32 on the CPU:

- ``log_softmax``: ``algos.selective_log_softmax`` one row's positions at a time (its chunking until
  2026-12-04, to bound peak memory) against its default chunk (``algos.logprobs.default_chunk``),
  forward and backward of the logits [64, 33, 860] (SmolLM2's vocabulary: ``benchmarks/logprob_pass.py``);
- ``entropy``: ``algos.entropy_from_logits`` the same two ways, no gradient;
- ``adamw``: one optimizer step over the policy's 50 parameter tensors, torch's single-tensor AdamW
  (r3lightning's) against ``foreach=True`` and ``fused=True``, and whether each leaves the very same
  weights after 20 steps;
- ``attention``: the policy's forward and backward over the 64 right-padded rows with transformers'
  ``sdpa`` attention (the default) against its ``eager`` one;
- ``compile``: the same forward and backward (``sdpa``) eagerly against ``torch.compile`` of the
  policy (inductor, static shapes), its first call's seconds and its largest logit difference: the
  ceiling of what compiling the training forward could save at these shapes;
- ``forward``: that forward and backward against its forward alone, with autograd recording and
  without (a frozen reference's or teacher's forward), and against a reference pass (the no-grad
  forward plus the sampled tokens' log-probs): what share of the update a frozen model's pass over the
  same rows costs.

Each pair runs alternately (``--repeats`` rounds); a figure is the median over rounds of each round's
median call. Whether an alternative is exact is part of the result: a change that is not bit-identical
changes every seeded run's numbers.

    python -m benchmarks.update_parts --out benchmarks/results/update_parts_cpu.json --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

ROWS, PROMPT = 64, 22
PARTS = ("log_softmax", "entropy", "adamw", "attention", "compile", "forward")


def median_call(fn: Callable[[], object], calls: int) -> float:
    """Median seconds of ``calls`` calls of ``fn`` after two untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternate(candidates: dict[str, Callable[[], object]], repeats: int, calls: int) -> dict[str, list[float]]:
    """Each candidate's median call per round, the candidates alternating within every round."""
    rounds: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            rounds[name].append(median_call(fn, calls))
    return rounds


def adamw_rounds(model, repeats: int, calls: int, figures: dict[str, object]) -> dict[str, list[float]]:
    """One AdamW step over ``model``'s parameters, single-tensor against ``foreach`` and ``fused``; whether each
    leaves the very same weights after 20 steps goes into ``figures``."""
    import torch

    policies = {kind: copy.deepcopy(model) for kind in ("single_tensor", "foreach", "fused")}
    options = {"single_tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    optimizers = {kind: torch.optim.AdamW(p.parameters(), lr=1e-3, weight_decay=0.01, **options[kind]) for kind, p in policies.items()}
    gradients = [torch.randn_like(p) * 1e-2 for p in model.parameters()]

    def adam_step(kind: str) -> Callable[[], None]:
        def run() -> None:
            for parameter, gradient in zip(policies[kind].parameters(), gradients):
                parameter.grad = gradient.clone()
            optimizers[kind].step()

        return run

    # Exactness first, from the same start: 20 steps each.
    for kind in policies:
        for _ in range(20):
            adam_step(kind)()
    reference = list(policies["single_tensor"].parameters())
    for kind in ("foreach", "fused"):
        figures[f"adamw_{kind}_exact"] = all(torch.equal(a, b) for a, b in zip(reference, policies[kind].parameters()))
    figures["adamw_parameter_tensors"] = len(reference)
    return alternate({kind: adam_step(kind) for kind in policies}, repeats, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--new_tokens", type=int, default=32, help="completion length of the batch (grpo_step's 32 or 64)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="the pairs to run (default: all)")
    args = parser.parse_args()
    if args.new_tokens < 9:  # the batch's completions run from 8 tokens up to new_tokens - 1
        parser.error(f"--new_tokens must be at least 9, got {args.new_tokens}")
    new = args.new_tokens
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.grpo_step import write_model
    from scripts.machine_info import machine_info
    from r3lightning.algos.logprobs import entropy_from_logits, selective_log_softmax

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        info = write_model(Path(directory))
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    vocab = info["vocab"]
    logits = torch.randn(ROWS, new + 1, vocab)
    ids = torch.randint(0, vocab, (ROWS, new + 1))

    one_row = (new + 1) * vocab  # a budget of one row's logits: one row at a time

    def rows_log_softmax(x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        return selective_log_softmax(x, token_ids, max_logits=one_row)

    def forward_backward(fn: Callable) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            leaf = logits.clone().requires_grad_()
            out = fn(leaf, ids)
            out.sum().backward()
            return leaf.grad

        return run

    figures: dict[str, object] = {}
    rounds: dict[str, dict[str, list[float]]] = {}
    if "log_softmax" in args.parts:
        rounds["log_softmax"] = alternate({"rows": forward_backward(rows_log_softmax),
                                           "chunked": forward_backward(selective_log_softmax)}, args.repeats, args.calls)
        figures["log_softmax_exact"] = bool(torch.equal(forward_backward(rows_log_softmax)(),
                                                        forward_backward(selective_log_softmax)()))
    if "entropy" in args.parts:
        with torch.no_grad():
            rounds["entropy"] = alternate({"rows": lambda: entropy_from_logits(logits, max_logits=one_row),
                                           "chunked": lambda: entropy_from_logits(logits)}, args.repeats, args.calls)
            figures["entropy_exact"] = bool(torch.equal(entropy_from_logits(logits, max_logits=one_row), entropy_from_logits(logits)))
    if "adamw" in args.parts:
        rounds["adamw"] = adamw_rounds(model, args.repeats, args.calls, figures)

    token_ids = torch.randint(3, vocab, (ROWS, PROMPT + new))
    mask = torch.ones_like(token_ids)
    for row in range(ROWS):
        mask[row, PROMPT + 8 + row % (new - 8):] = 0  # completions of 8 to new-1 tokens, right-padded
    valid = mask.bool()
    few_calls = max(args.calls // 3, 3)

    def forward_backward_of(policy, forward) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            policy.zero_grad(set_to_none=True)
            out = forward(input_ids=token_ids, attention_mask=mask).logits
            out.logsumexp(-1).sum().backward()
            return out.detach()

        return run

    if "attention" in args.parts:
        def attention(implementation: str) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                model.set_attn_implementation(implementation)
                return forward_backward_of(model, model)()

            return run

        rounds["attention"] = alternate({"sdpa": attention("sdpa"), "eager": attention("eager")}, args.repeats, few_calls)
        figures["attention_eager_max_abs_logit_diff"] = float((attention("sdpa")() - attention("eager")())[valid].abs().max())
        model.set_attn_implementation("sdpa")

    if "compile" in args.parts:
        compiled_policy = copy.deepcopy(model)
        compiled_forward = torch.compile(compiled_policy, dynamic=False)
        start = time.perf_counter()
        compiled_logits = forward_backward_of(compiled_policy, compiled_forward)()
        figures["compile_first_call_s"] = round(time.perf_counter() - start, 1)
        figures["compile_max_abs_logit_diff"] = float((compiled_logits - forward_backward_of(model, model)())[valid].abs().max())
        rounds["compile"] = alternate({"eager": forward_backward_of(model, model),
                                       "compiled": forward_backward_of(compiled_policy, compiled_forward)},
                                      args.repeats, few_calls)

    if "forward" in args.parts:
        def forward_only() -> torch.Tensor:
            return model(input_ids=token_ids, attention_mask=mask).logits.logsumexp(-1).sum()

        def forward_no_grad() -> torch.Tensor:
            with torch.no_grad():
                return forward_only()

        def reference_pass() -> torch.Tensor:
            # What a frozen reference's pass adds to the bare forward: the sampled tokens' log-probs.
            with torch.no_grad():
                out = model(input_ids=token_ids, attention_mask=mask).logits[:, :-1]
                return selective_log_softmax(out, token_ids[:, 1:]).float()

        rounds["forward"] = alternate({"forward_backward": forward_backward_of(model, model), "forward_grad": forward_only,
                                       "forward_no_grad": forward_no_grad, "reference_pass": reference_pass},
                                      args.repeats, few_calls)

    for part, by_candidate in rounds.items():
        for candidate, values in by_candidate.items():
            figures[f"{part}_{candidate}_ms"] = round(statistics.median(values) * 1e3, 3)
            figures[f"{part}_{candidate}_ms_rounds"] = [round(v * 1e3, 3) for v in values]
        first = next(iter(by_candidate))
        for candidate in list(by_candidate)[1:]:
            ratios = [c / f for c, f in zip(by_candidate[candidate], by_candidate[first])]
            figures[f"{part}_{candidate}_over_{first}"] = round(statistics.median(ratios), 3)
    record = {
        "benchmark": "update_parts",
        "figures": figures,
        "config": {"model": info, "rows": ROWS, "prompt_tokens": PROMPT, "new_tokens": new, "threads": args.threads,
                   "repeats": args.repeats, "calls": args.calls,
                   "statistic": "per round: median call; reported: median over alternating rounds; ratios: median of per-round ratios"},
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
