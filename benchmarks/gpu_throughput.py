"""GPU throughput: the ``hf`` engine's decoding (eager and compiled) on the Qwen2-0.5B shape, and
bf16-mixed training throughput with MFU on a ~100M-parameter model, for a GPU session
(``scripts/gpu_session.sh``). Without CUDA it writes a JSON whose figures say "not run".

    OUT=/tmp/out; python -m benchmarks.gpu_throughput --out $OUT/gpu_throughput.json      # ~3 min on an H200

1. Rollout: ``HFEngine.generate`` at batch ``--batch`` (128) on a random-init Qwen2-0.5B shape (hidden 896,
   24 layers, 14 heads, 2 KV heads, MLP 4864, vocab 151936, bfloat16), 32-token prompts, 64 new tokens at
   temperature 1: the eager engine (``decode="fused"``), the eager engine
   decoding with the model's forward (``decode="forward"``) and the compiled one (``decode="generate_compiled"``: static KV cache,
   ``torch.compile`` of the decoding step, ``mode="reduce-overhead"``: CUDA graphs) and the engine with
   its fused step and sampler compiled (``decode="fused_compiled"``, torch's default mode), interleaved
   ``--repeats`` times (median), after a warm-up that includes compilation (reported). The issue's
   reference is 1503 tokens/s for the eager engine at batch 128 on an H200 (rollout_throughput_gpu.json);
   the goal is >= 5x that.
2. Training: ``R3LightningModule.optimize`` on a fixed GRPO-shaped batch (64 sequences of up to 512
   tokens, micro-batches of 16, PPO-clip, token mean) inside ``Trainer.fit`` with
   ``precision="bf16-mixed"``, at each ``--train-sizes`` entry (default a ~100M-parameter Qwen2 of
   hidden 1024 and a ~0.5B one of hidden 1536; float32 master weights and AdamW states). Tokens/s over all (non-padding)
   tokens and MFU = 6 x parameters x tokens/s / the device's dense bf16 peak (``--peak-tflops``, or a
   table of known devices: H200/H100 989 TFLOP/s, A100 312).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from scripts.machine_info import machine_info  # noqa: E402

BASELINE_TOKENS_PER_S = 1502.8  # hf engine, batch 128, H200, before the compiled path (rollout_throughput_gpu.json)
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def rollout(args) -> dict:
    from benchmarks.rollout_throughput import build_model, make_prompts

    from r3lightning.training.models import build_tokenizer
    from r3lightning.engines.base import SamplingParams
    from r3lightning.engines.hf.engine import HFEngine

    corpus = [f"What is {a} + {b}? The answer is \\boxed{{{a + b}}}." for a in range(60) for b in range(0, 60, 7)]
    tokenizer = build_tokenizer(corpus, 1024)
    policy = build_model("qwen2-0.5b", tokenizer, "bfloat16", "cuda")
    prompts = make_prompts(tokenizer, args.batch, 32, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=64)
    engines = {
        "eager": HFEngine(policy, tokenizer, max_batch_size=args.batch, prefix_cache=False),
        "eager_forward": HFEngine(policy, tokenizer, max_batch_size=args.batch, prefix_cache=False, decode="forward"),
        "compiled": HFEngine(policy, tokenizer, max_batch_size=args.batch, prefix_cache=False, decode="generate_compiled",
                             compile_mode=args.compile_mode),
        # The fused step and sampler compiled (torch's default mode: its buffers are written in place,
        # which CUDA graphs of the reduce-overhead mode would skip).
        "fused_compiled": HFEngine(policy, tokenizer, max_batch_size=args.batch, prefix_cache=False, decode="fused_compiled"),
    }

    def run(engine) -> tuple[float, int]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        torch.cuda.synchronize()
        return time.perf_counter() - start, sum(len(g.token_ids) for g in out)

    warmup_s, failed = {}, {}
    for name, engine in list(engines.items()):
        start = time.perf_counter()
        try:
            run(engine)
            run(engine)
        except Exception as err:  # noqa: BLE001 - a path that fails to compile is reported, the others still timed
            failed[name] = repr(err)[:2000]
            del engines[name]
            print(f"{name}: failed {failed[name][:300]}", flush=True)
            continue
        warmup_s[name] = round(time.perf_counter() - start, 2)
        print(f"{name}: warm-up {warmup_s[name]} s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            seconds, tokens = run(engine)
            rates[name].append(tokens / seconds)
            print(f"{name}: {tokens / seconds:.0f} tokens/s", flush=True)
    figures = {f"hf_{name}_tokens_per_s_batch{args.batch}": round(statistics.median(r), 1) for name, r in rates.items()}
    eager = figures[f"hf_eager_tokens_per_s_batch{args.batch}"]
    for name in ("compiled", "fused_compiled"):
        if name in engines:
            figures[f"{name}_over_eager"] = round(figures[f"hf_{name}_tokens_per_s_batch{args.batch}"] / eager, 2)
            figures[f"{name}_over_issue_baseline"] = round(figures[f"hf_{name}_tokens_per_s_batch{args.batch}"] / BASELINE_TOKENS_PER_S, 2)
    if "eager_forward" in engines:
        figures["fused_over_forward"] = round(eager / figures[f"hf_eager_forward_tokens_per_s_batch{args.batch}"], 2)
    best = max((figures[f"hf_{n}_tokens_per_s_batch{args.batch}"] for n in ("compiled", "fused_compiled") if n in engines), default=0.0)
    figures["goal_5x_baseline_met"] = best >= 5 * BASELINE_TOKENS_PER_S
    figures["failed"] = failed
    return {
        "figures": figures,
        "config": {
            "model": "qwen2-0.5b (random init)", "params": sum(p.numel() for p in policy.parameters()),
            "dtype": "bfloat16", "batch": args.batch, "prompt_tokens": 32, "max_new_tokens": 64, "temperature": 1.0,
            "repeats": args.repeats, "statistic": "median of interleaved runs", "warmup_s_incl_compile": warmup_s,
            "compile_stats": {name: engine.compile_stats() for name, engine in engines.items() if "compiled" in name},
            "per_repeat_tokens_per_s": rates,
            "baseline_tokens_per_s": BASELINE_TOKENS_PER_S,
        },
    }


def training(args) -> dict:
    """bf16-mixed update throughput and MFU at each of ``args.train_sizes`` ("PARAMS:HIDDEN")."""
    parts = {}
    for size in args.train_sizes:
        target, hidden = (int(x) for x in size.split(":"))
        parts[size] = training_at(args, target, hidden)
        torch.cuda.empty_cache()
    return {"figures": {size: part["figures"] for size, part in parts.items()},
            "config": {size: part["config"] for size, part in parts.items()}}


def training_at(args, target_params: int, hidden_size: int) -> dict:
    import lightning as L
    from benchmarks.train_throughput import fill_behaviour_logprobs, make_experience, tiny_spec

    from r3lightning.algos.objective import AlgorithmConfig
    from r3lightning.data.datamodule import RolloutDataModule, corpus_from_suite
    from r3lightning.envs.math_env import MathSuite
    from r3lightning.training.models import ModelConfig, build_tiny_model, build_tokenizer, count_parameters
    from r3lightning.module import R3LightningModule
    from r3lightning.training.optim import OptimConfig
    from r3lightning.rollout.agent_loop import AgentLoopConfig

    class Bench(R3LightningModule):
        def configure_model(self) -> None:
            if self.policy is None:
                self._install(self.bench_policy, self.bench_tokenizer)

        def training_step(self, batch, batch_idx: int) -> None:
            torch.cuda.synchronize()
            start = time.perf_counter()
            self.optimize(self.experience)
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - start)

    suite = MathSuite(source="arithmetic", num_val_tasks=4, instruction="")
    agent = AgentLoopConfig(action_format="raw", max_context_tokens=args.seq_len)
    tokenizer = build_tokenizer(corpus_from_suite(suite, agent), vocab_size=1024)
    spec = tiny_spec(len(tokenizer), target_params, hidden_size)
    policy = build_tiny_model(spec, tokenizer, seed=0)
    params = count_parameters(policy)
    experience = make_experience(64, args.seq_len, len(tokenizer), tokenizer.pad_token_id, seed=0)
    fill_behaviour_logprobs(policy, experience, 16)
    module = Bench(model=ModelConfig(tiny=spec), algorithm=AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip"),
                   optim=OptimConfig(lr=1e-5, micro_batch_size=16, grad_clip=1.0))
    module.bench_policy, module.bench_tokenizer, module.experience, module.times = policy, tokenizer, experience, []
    steps = args.train_warmup + args.train_steps
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, RolloutDataModule(suite, group_size=8, tasks_per_step=1, agent=agent))
    step_s = statistics.median(module.times[args.train_warmup:])
    tokens = float(experience.attention_mask.sum())
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in torch.cuda.get_device_name(0)), None)
    figures = {"train_tokens_per_s": round(tokens / step_s, 1), "train_step_s": round(step_s, 4), "params": params}
    if peak:
        figures["mfu"] = round(6 * params * tokens / step_s / (peak * 1e12), 4)
    return {
        "figures": figures,
        "config": {"precision": "bf16-mixed", "model": spec.__dict__, "batch_sequences": 64, "seq_len": args.seq_len,
                   "micro_batch_size": 16, "tokens_per_step": tokens, "steps_timed": args.train_steps,
                   "peak_bf16_tflops": peak, "mfu_definition": "6 x params x tokens/s / dense bf16 peak",
                   "step_s_all": module.times},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-mode", default="reduce-overhead")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--train-warmup", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (TFLOP/s)")
    parser.add_argument("--train-sizes", nargs="+", default=["100000000:1024", "500000000:1536"],
                        help="training shapes as TARGET_PARAMS:HIDDEN_SIZE (depth is chosen to fit)")
    parser.add_argument("--parts", nargs="+", choices=["training", "rollout"], default=["training", "rollout"],
                        help="what to measure, in this order (the cheaper training first)")
    args = parser.parse_args()
    result = {"benchmark": "gpu_throughput", "figures": {}, "config": {}, "machine": machine_info()}
    if not torch.cuda.is_available():
        result["figures"] = {"rollout": "not run (no CUDA device)", "training": "not run (no CUDA device)"}
        result["config"] = {"reason": "written on a machine without CUDA; run on a GPU to fill it", "args": vars(args)}
    else:
        result["machine"]["gpu"] = torch.cuda.get_device_name(0)
        errors = []
        for name in args.parts:
            fn = {"rollout": rollout, "training": training}[name]
            try:
                part = fn(args)
                result["figures"][name] = part["figures"]
                result["config"][name] = part["config"]
            except Exception as err:  # noqa: BLE001 - one part failing should not lose the other
                errors.append(f"{name}: {err!r}")
                result["figures"][name] = f"failed: {err!r}"
            torch.cuda.empty_cache()
            write(result, args.out)  # after each part, so a run stopped at its time limit keeps the first
        result["config"]["errors"] = errors
    write(result, args.out)
    print(json.dumps(result["figures"], indent=2, default=str))


def write(result: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
