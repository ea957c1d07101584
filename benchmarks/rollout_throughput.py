"""Rollout throughput of the ``hf`` and ``vllm`` engines, and vLLM weight-sync time vs model size.

    python -m benchmarks.rollout_throughput --out benchmarks/results/rollout_throughput_cpu.json
    python -m benchmarks.rollout_throughput --preset gpu-0.5b --out $OUT/rollout_throughput_gpu.json

``--decode-curve`` measures instead the cost of one decoding step of the ``hf`` engine against the
batch size (1..256): ms per step, from the difference of two ``generate`` calls with 1 and 1 + ``--curve-steps``
new tokens (so prefill cancels), the median of ``--repeats`` interleaved passes, and its ratio to the step's
FLOP limit (2 x matmul parameters x batch + attention over the context, at this machine's measured
float32 matmul rate: the best of square 1024 and 2048 matmuls), for the eager engine with its fused
decoding step (``fused``, the default) and with the model's forward (``forward``), interleaved.
``--curve-compile`` adds the compiled decoding path (``HFEngine(decode="generate_compiled")``) at the batch sizes
given, with its compile time:

    python -m benchmarks.rollout_throughput --decode-curve --out benchmarks/results/decode_curve_cpu.json

Generated tokens/s (sampled at temperature 1, prompts of random token ids; best of ``--repeats``
runs) at several batch sizes for both engines on a random-init Qwen2 model built from a config (no downloads), then the time of one
full weight sync (``iter_policy_weights`` -> buckets -> ``VLLMEngine.load_weights``, as the
``VLLMWeightSync`` callback does it) for models of increasing size. Writes one JSON object:
``{"benchmark", "figures", "config", "machine"}``; figure names carry their units.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from scripts.machine_info import machine_info  # noqa: E402

from r3lightning.training.models import build_tokenizer  # noqa: E402
from r3lightning.engines.base import SamplingParams  # noqa: E402
from r3lightning.engines.hf.engine import HFEngine  # noqa: E402

# name -> (hidden, layers, heads, kv heads, intermediate, vocab (0: the tokenizer's), tied)
MODELS = {
    "cpu-5m": (256, 6, 8, 4, 768, 0, True),
    "cpu-20m": (512, 6, 16, 8, 1536, 0, True),
    "cpu-80m": (1024, 6, 32, 8, 3072, 0, True),
    "qwen2-0.5b-6l": (896, 6, 14, 2, 4864, 151936, True),
    "qwen2-0.5b-12l": (896, 12, 14, 2, 4864, 151936, True),
    "qwen2-0.5b": (896, 24, 14, 2, 4864, 151936, True),
}
PRESETS = {
    "cpu": dict(model="cpu-5m", batches=[8, 32, 128], sync_models=["cpu-5m", "cpu-20m", "cpu-80m"], dtype="float32", device="cpu"),
    "gpu-0.5b": dict(model="qwen2-0.5b", batches=[8, 32, 128], sync_models=["qwen2-0.5b-6l", "qwen2-0.5b-12l", "qwen2-0.5b"], dtype="bfloat16", device="cuda"),
}


def build_model(name: str, tokenizer, dtype: str, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv, inter, vocab, tied = MODELS[name]
    config = Qwen2Config(
        vocab_size=vocab or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=2048, tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(device).eval()


def make_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    g = torch.Generator().manual_seed(seed)
    return [[ids[int(j)] for j in torch.randint(len(ids), (length,), generator=g)] for _ in range(n)]


def tokens_per_s(engine, prompts, params, repeats: int) -> tuple[float, int, float]:
    """Best of ``repeats`` runs (the least disturbed by other load on the machine)."""
    best = (0.0, 0, 0.0)
    for i in range(repeats):
        torch.manual_seed(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in out)
        if tokens / seconds > best[0]:
            best = (tokens / seconds, tokens, seconds)
    return best


def batch_sweep(name: str, engine, prompts, params, args) -> dict[str, float]:
    """``{name}_tokens_per_s_batch{b}`` and ``{name}_generate_s_batch{b}`` for every batch size, after a warm-up."""
    engine.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4))
    figures = {}
    for batch in args.batches:
        rate, tokens, seconds = tokens_per_s(engine, prompts[:batch], params, args.repeats)
        figures[f"{name}_tokens_per_s_batch{batch}"] = round(rate, 1)
        figures[f"{name}_generate_s_batch{batch}"] = round(seconds, 3)
        print(f"{name:5s} batch {batch:4d}: {rate:10.1f} tok/s ({tokens} tokens, {seconds:.2f} s)", flush=True)
    return figures


def vllm_engine(policy, tokenizer, args, dtype: str, sleep_mode: bool = False, for_sync: bool = False):
    from r3lightning.engines.vllm.engine import VLLMEngine

    kv_cache_gb = args.kv_cache_gb
    if for_sync and torch.cuda.is_available():
        kv_cache_gb = kv_cache_gb or 2.0  # the sweep's engines only load weights
    return VLLMEngine.from_policy(
        policy, tokenizer, max_batch_size=max(args.batches), dtype=dtype, kv_cache_gb=kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.prompt_len + args.new_tokens + 16,
        enforce_eager=True if for_sync else args.enforce_eager, sleep_mode=sleep_mode,
    )


def sync_seconds(engine, policy, bucket_mb: int) -> tuple[float, int]:
    from r3lightning.engines.vllm.weights import iter_policy_weights, iter_weight_buckets

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    buckets = iter_weight_buckets(iter_policy_weights(policy), bucket_mb << 20, device=engine.device)
    sent = engine.load_weights(item for bucket in buckets for item in bucket)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, sent


def machine() -> dict:
    info = machine_info()
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception as err:  # noqa: BLE001
        info["vllm"] = f"unavailable: {err}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def matmul_rate(dtype: torch.dtype, device: str) -> dict:
    """This machine's dense matmul rate (FLOP/s, best of a few sizes and runs) with the current threads."""
    best = {}
    for n in (1024, 2048):
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        a @ b
        runs = []
        for _ in range(5):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            a @ b
            if device == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
        best[n] = 2 * n**3 / min(runs)
    return {"flops_per_s": max(best.values()), "by_size": {str(k): round(v / 1e9, 1) for k, v in best.items()}}


def decode_step_flops(model, batch: int, context: int) -> float:
    """FLOPs of one decoding step: 2 x (parameters in matmuls, the LM head included, embeddings not)
    x batch, plus attention (QK^T and PV over ``context`` cached tokens: 4 x layers x heads x head_dim)."""
    config = model.config
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    if getattr(config, "tie_word_embeddings", False):
        matmul += model.get_input_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * context
    return batch * (2 * matmul + attention)


def decode_curve(args, preset, tokenizer) -> dict:
    """ms per decoding step vs batch size: the eager hf engine with its fused decoding step (``fused``) and
    with the model's forward (``forward``, ``hf_decode: forward``); compiled at ``--curve-compile`` batches."""
    device, dtype = preset["device"], preset["dtype"]
    policy = build_model(preset["model"], tokenizer, dtype, device)
    rate = matmul_rate(getattr(torch, dtype), device)
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    prompts = make_prompts(tokenizer, max(batches), args.prompt_len, seed=0)
    steps = args.curve_steps
    short = SamplingParams(temperature=1.0, max_new_tokens=1)
    # Rows that sample the end-of-turn token keep decoding as padding until every row has stopped, so a
    # pass runs the whole budget unless all rows stop early (then it is dropped, see ``timed``).
    long = SamplingParams(temperature=1.0, max_new_tokens=1 + steps)
    engines = {
        "fused": HFEngine(policy, tokenizer, max_batch_size=max(batches), prefix_cache=False, decode="fused"),
        "forward": HFEngine(policy, tokenizer, max_batch_size=max(batches), prefix_cache=False, decode="forward"),
    }
    compiled_batches = set(args.curve_compile or [])
    if compiled_batches:
        engines["compiled"] = HFEngine(policy, tokenizer, max_batch_size=max(batches), prefix_cache=False, decode="generate_compiled")

    def timed(engine, batch, params) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts[:batch], params)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if params is long and max(len(g.token_ids) for g in out) < 1 + steps:
            return float("nan")  # every row stopped early (rare with random prompts): not a full pass
        return seconds

    compile_s = {}
    for name, engine in engines.items():  # warm-up (and compilation) outside the timed passes
        for batch in batches:
            if name == "compiled" and batch not in compiled_batches:
                continue
            start = time.perf_counter()
            timed(engine, batch, short)
            timed(engine, batch, long)
            if name == "compiled":
                compile_s[batch] = round(time.perf_counter() - start, 2)
                print(f"compiled batch {batch}: warm-up incl. compilation {compile_s[batch]:.1f} s", flush=True)
    samples = {(name, b): [] for name in engines for b in batches}
    for _ in range(args.repeats):
        for batch in batches:
            for name, engine in engines.items():
                if name == "compiled" and batch not in compiled_batches:
                    continue
                torch.manual_seed(batch)
                samples[(name, batch)].append((timed(engine, batch, long) - timed(engine, batch, short)) / steps)
    figures, rows = {}, []
    for (name, batch), values in samples.items():
        values = [v for v in values if v == v]
        if not values:
            continue
        ms = statistics.median(values) * 1e3
        limit_ms = decode_step_flops(policy, batch, args.prompt_len + 1 + steps // 2) / rate["flops_per_s"] * 1e3
        figures[f"{name}_decode_ms_per_step_batch{batch}"] = round(ms, 3)
        figures[f"{name}_decode_over_flop_limit_batch{batch}"] = round(ms / limit_ms, 2)
        figures[f"{name}_decode_tokens_per_s_batch{batch}"] = round(batch / ms * 1e3, 1)
        rows.append((name, batch, ms, limit_ms))
        print(f"{name:8s} batch {batch:4d}: {ms:8.3f} ms/step, FLOP limit {limit_ms:7.3f} ms, ratio {ms / limit_ms:7.1f}", flush=True)
    for batch in batches:
        if f"fused_decode_ms_per_step_batch{batch}" in figures and f"forward_decode_ms_per_step_batch{batch}" in figures:
            figures[f"fused_over_forward_batch{batch}"] = round(
                figures[f"fused_decode_ms_per_step_batch{batch}"] / figures[f"forward_decode_ms_per_step_batch{batch}"], 3)
    for batch in compiled_batches:
        if f"compiled_decode_ms_per_step_batch{batch}" in figures and f"forward_decode_ms_per_step_batch{batch}" in figures:
            figures[f"compiled_over_forward_batch{batch}"] = round(
                figures[f"compiled_decode_ms_per_step_batch{batch}"] / figures[f"forward_decode_ms_per_step_batch{batch}"], 3)
    return {
        "figures": figures,
        "config": {
            "model": preset["model"], "params": sum(p.numel() for p in policy.parameters()), "dtype": dtype, "device": device,
            "batches": batches, "prompt_tokens": args.prompt_len, "decode_steps_timed": steps, "repeats": args.repeats,
            "matmul_rate_gflops": round(rate["flops_per_s"] / 1e9, 1), "matmul_rate_by_size_gflops": rate["by_size"],
            "flop_limit": "2 x matmul params x batch + 4 x layers x heads x head_dim x context x batch, at the matmul rate",
            "statistic": "median of interleaved passes of (t(1 + steps new tokens) - t(1 new token)) / steps",
            "compiled_batches": sorted(compiled_batches), "compile_warmup_s": compile_s,
            "compile_stats": engines["compiled"].compile_stats() if "compiled" in engines else None,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--kv-cache-gb", type=float, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--skip-hf", action="store_true", help="only the vllm engine")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the best one counts")
    parser.add_argument("--decode-curve", action="store_true", help="ms per decoding step vs batch size (hf engine) only")
    parser.add_argument("--curve-steps", type=int, default=32, help="decoding steps timed per pass of the curve")
    parser.add_argument("--curve-compile", type=int, nargs="*", default=[], help="batch sizes also timed compiled")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    args.batches = preset["batches"]
    device, dtype = preset["device"], preset["dtype"]
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--preset {args.preset} needs a CUDA device")

    corpus = [f"What is {a} + {b}? The answer is \\boxed{{{a + b}}}." for a in range(60) for b in range(0, 60, 7)]
    tokenizer = build_tokenizer(corpus, 1024)
    if args.decode_curve:
        curve = decode_curve(args, preset, tokenizer)
        result = {"benchmark": "decode_curve", **curve, "machine": machine()}
        result["config"]["preset"] = args.preset
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["figures"], indent=2))
        return
    policy = build_model(preset["model"], tokenizer, dtype, device)
    num_params = sum(p.numel() for p in policy.parameters())
    prompts = make_prompts(tokenizer, max(args.batches), args.prompt_len, seed=0)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens)
    figures: dict[str, float] = {}
    errors: list[str] = []

    if not args.skip_hf:
        hf = HFEngine(policy, tokenizer, max_batch_size=max(args.batches))
        figures.update(batch_sweep("hf", hf, prompts, params, args))
        del hf

    sync_models = {}
    if importlib.util.find_spec("vllm") is None:
        # The GPU machine has no package index and vLLM's wheel is far larger than what can be carried
        # there: the hf figures still count, the vllm ones are reported missing.
        errors.append("vllm is not installed: vllm figures and the weight-sync sweep were skipped")
        print(errors[-1], flush=True)
    else:
        start = time.perf_counter()
        engine = vllm_engine(policy, tokenizer, args, dtype, sleep_mode=device == "cuda")
        figures["vllm_startup_s"] = round(time.perf_counter() - start, 2)
        figures.update(batch_sweep("vllm", engine, prompts, params, args))
        for batch in args.batches:
            if f"hf_tokens_per_s_batch{batch}" in figures:
                figures[f"vllm_over_hf_speedup_batch{batch}"] = round(
                    figures[f"vllm_tokens_per_s_batch{batch}"] / figures[f"hf_tokens_per_s_batch{batch}"], 2
                )
        if engine.sleep_mode:
            try:
                t0 = time.perf_counter()
                engine.sleep()
                t1 = time.perf_counter()
                engine.wake_up()
                figures["vllm_sleep_s"] = round(t1 - t0, 3)
                figures["vllm_wake_s"] = round(time.perf_counter() - t1, 3)
            except Exception as err:  # noqa: BLE001
                errors.append(f"sleep/wake: {err!r}")
        engine.close()
        del engine
        gc.collect()

        for name in preset["sync_models"]:
            try:
                model = policy if name == preset["model"] else build_model(name, tokenizer, dtype, device)
                n = sum(p.numel() for p in model.parameters())
                eng = vllm_engine(model, tokenizer, args, dtype, for_sync=True)
                sync_seconds(eng, model, args.bucket_mb)  # warm-up
                runs = [sync_seconds(eng, model, args.bucket_mb) for _ in range(max(args.repeats, 3))]
                seconds = min(s for s, _ in runs)
                sent = runs[0][1]
                figures[f"sync_s_{name}"] = round(seconds, 4)
                figures[f"sync_params_{name}"] = n
                figures[f"sync_gb_per_s_{name}"] = round(sent / seconds / 1e9, 3)
                sync_models[name] = {"params": n, "bytes_sent": sent}
                print(f"sync  {name:16s}: {n / 1e6:8.1f} M params, {sent / 2**20:8.1f} MiB in {seconds:.3f} s", flush=True)
                eng.close()
                del eng, model
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception as err:  # noqa: BLE001
                errors.append(f"sync {name}: {err!r}")
                print(f"sync  {name}: failed: {err!r}", flush=True)
    sizes = [(sync_models[m]["params"] / 1e6, figures[f"sync_s_{m}"]) for m in sync_models]
    if len(sizes) >= 2:
        # Least squares: sync_s = fixed + slope * million params.
        mx, my = statistics.fmean(x for x, _ in sizes), statistics.fmean(y for _, y in sizes)
        var = sum((x - mx) ** 2 for x, _ in sizes)
        slope = sum((x - mx) * (y - my) for x, y in sizes) / var if var else 0.0
        figures["sync_fit_ms_per_million_params"] = round(slope * 1e3, 4)
        figures["sync_fit_fixed_s"] = round(my - slope * mx, 4)

    result = {
        "benchmark": "rollout_throughput",
        "figures": figures,
        "config": {
            "preset": args.preset,
            "model": preset["model"],
            "model_shape": dict(zip(("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied"), MODELS[preset["model"]])),
            "params": num_params,
            "dtype": dtype,
            "device": device,
            "batches": args.batches,
            "prompt_tokens": args.prompt_len,
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "repeats": args.repeats,
            "statistic": "best of repeats (throughput and sync time)",
            "vllm_enforce_eager": args.enforce_eager,
            "vllm_kv_cache_gb": args.kv_cache_gb,
            "bucket_mb": args.bucket_mb,
            "sync_models": sync_models,
            "errors": errors,
            "env": {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")},
        },
        "machine": machine(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["figures"], indent=2))


if __name__ == "__main__":
    main()
