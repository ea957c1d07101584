"""Agent-loop throughput: episodes/s and environment steps/s versus the number of concurrent episodes.

One ``AgentLoop.run`` plays ``batch`` episodes at once (one batched engine call per turn of all active
episodes). This measures it on the procedural text world (difficulty 1, its default 8-turn limit) with
the tiny model of the tests (hidden size 64, one layer; briefly fine-tuned, see below) on the ``hf``
engine, at batch 1, 16 and 64. Every batch size
plays the same number of episodes (``--episodes``, default 64: 64 runs of 1, 4 runs of 16, 1 run of 64)
on the same tasks, after one warm-up run.

The random-init model never writes a well-formed ``<action>`` block, so every turn would answer
"Invalid action format" without calling the environment. The model is therefore first fine-tuned for
``--sft-steps`` (150) steps on expert demonstrations of other tasks (about 30 s on CPU), after which
most turns reach the environment and some episodes succeed (ending early, so later turns of a run
have smaller batches). ``env_steps`` counts turns (each is one step of the step limit, as the agent
loop books them); ``env_calls`` counts the ``Environment.step`` calls among them. Time is split into
the engine's ``generate`` calls and everything else in the loop (tokenizing observations, bookkeeping,
environment steps); the ``other_s_per_turn_*`` figures are that remainder per turn.

Threads: the default is one torch thread. With one per core on a 2-core machine shared with other
processes, every tiny matmul of this model waits on OpenMP barriers, which cost more than the arithmetic
(docs/results.md has the measurement).

What limits the speedup: at batch 1 a turn is mostly per-token overhead of the decoding loop; at batch
64 that overhead is shared and the cost is attention and prefill. The prefix cache
(``HFEngine(prefix_cache=True)``, the default) keeps each finished sequence's KV, so a turn prefills only
its new observation instead of the whole conversation; ``--no-prefix-cache`` measures the engine
without it. The fused prefill (the engine's default on the CPU) attends from each row's last column
only in the last layer, so with the default one-layer model the observation's prefill does almost no
attention; ``--num-layers 4`` shows a deeper model, where it still does.

Each batch size is timed ``--repeats`` times (default 3), interleaved (1, 16, 64, 1, 16, 64, ...) so that
load from other processes falls on all of them alike; the median pass is reported.

    python -m benchmarks.agent_loop_throughput --out benchmarks/results/agent_loop_throughput_cpu.json
    python -m benchmarks.agent_loop_throughput --no-prefix-cache \
        --out benchmarks/results/agent_loop_throughput_cpu_no_prefix_cache.json

It measures the r3lightning it imports, which ``python -m`` takes from the working directory. To measure
another checkout (e.g. a git worktree of an older commit, ``scripts.worktrees``), run it from there with
this checkout on ``PYTHONPATH`` for the ``benchmarks`` package; the JSON's ``config.repo`` says which
checkout ran:

    cd /tmp/r3l-before && PYTHONPATH=/path/to/r3lightning python -m benchmarks.agent_loop_throughput --out ...
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

import r3lightning  # noqa: E402
from scripts.machine_info import machine_info  # noqa: E402
from benchmarks.timing import time_calls  # noqa: E402
from r3lightning.data.datamodule import corpus_from_suite  # noqa: E402
from r3lightning.envs.textworld_procedural import ProceduralWorldSuite  # noqa: E402
from r3lightning.training.models import TinyModelSpec, build_tiny_model, build_tokenizer, count_parameters  # noqa: E402
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig, EpisodeRequest  # noqa: E402
from r3lightning.engines.base import SamplingParams  # noqa: E402
from r3lightning.engines.hf.engine import HFEngine  # noqa: E402


def timed_generate(engine: HFEngine) -> list[tuple[float, int, int, int, int]]:
    """Time ``engine.generate``; the list it returns gets, per call, (wall time, batch size, generated
    tokens, prompt tokens, padded prompt tokens = batch size x longest prompt)."""
    calls: list[tuple[float, int, int, int, int]] = []

    def record(seconds, out, prompts, params) -> None:
        lengths = [len(p) for p in prompts]
        calls.append((seconds, len(prompts), sum(len(g.token_ids) for g in out), sum(lengths), len(lengths) * max(lengths)))

    time_calls(engine, "generate", record)
    return calls


def play(loop: AgentLoop, engine: HFEngine, calls: list, tasks, batch: int, params: SamplingParams, seed: int) -> dict:
    """Play ``tasks`` in runs of ``batch`` concurrent episodes; totals over all runs (``calls``: the
    engine's ``timed_generate`` list)."""
    calls.clear()
    engine.stats.update(prompt_tokens=0, reused_prompt_tokens=0)
    torch.manual_seed(seed)
    trajectories = []
    start = time.perf_counter()
    cpu_start = time.process_time()
    for i in range(0, len(tasks), batch):
        trajectories += loop.run([EpisodeRequest(task=t) for t in tasks[i : i + batch]], params)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    turns = sum(len(t.turns) for t in trajectories)
    env_calls = sum(1 for t in trajectories for turn in t.turns if turn.action)
    generate_s = sum(c[0] for c in calls)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "episodes": len(trajectories),
        "turns": turns,
        "env_calls": env_calls,
        "generated_tokens": sum(c[2] for c in calls),
        "generate_s": generate_s,
        "generate_calls": len(calls),
        "mean_generate_batch": statistics.fmean(c[1] for c in calls),
        "prompt_tokens": sum(c[3] for c in calls),
        "padded_prompt_tokens": sum(c[4] for c in calls),
        "prefix_cache_hit_rate": engine.cache_hit_rate(),
        "successes": sum(t.success for t in trajectories),
        "end_reasons": sorted({t.end_reason for t in trajectories}),
    }


def warm_start(model, loop: AgentLoop, suite, steps: int, lr: float, seed: int) -> dict:
    """A few SFT steps on expert demonstrations (tasks outside the benchmark's), so the policy writes
    well-formed actions and the environment is really stepped; returns the final loss and time."""
    from r3lightning.data.collate import collate_experience

    tasks = [suite.train_task(10_000 + i) for i in range(64)]
    demos = loop.play_actions([EpisodeRequest(task=t, origin="demo") for t in tasks], [suite.demonstration(t) for t in tasks])
    batch = collate_experience(demos, [0.0] * len(demos), loop.tokenizer.pad_token_id, pivotal_credit=False)
    mask = ((batch.loss_mask + batch.sft_mask) > 0).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    start, loss = time.perf_counter(), torch.tensor(0.0)
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(demos), (16,), generator=generator)
        logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits[:, :-1]
        target, weight = batch.input_ids[rows, 1:], mask[rows, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        loss = (nll * weight.reshape(-1)).sum() / weight.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return {"steps": steps, "lr": lr, "final_loss": loss.item(), "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--episodes", type=int, default=64, help="episodes played at every batch size")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--difficulty", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: torch's default). 1 by default: the tiny model's matrices "
                             "are too small to split, and on a busy machine OpenMP synchronization between threads "
                             "costs more than the arithmetic (see the module docstring)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=150,
                        help="SFT steps on expert demonstrations before timing (0: the random-init model)")
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes per batch size, interleaved across batch sizes so that load changes "
                             "on a shared machine hit all of them alike; the median pass is reported")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="re-prefill every episode's whole conversation on every turn (the engine before "
                             "its prefix cache)")
    parser.add_argument("--fused-compile", action="store_true",
                        help="decode with the engine's compiled fused step (engine.hf_decode: fused_compiled); its graphs' "
                             "compile times and the calls refused a graph are in config.compile")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    suite = ProceduralWorldSuite(difficulty=args.difficulty, num_val_tasks=8, seed=args.seed)
    agent = AgentLoopConfig()
    tokenizer = build_tokenizer(corpus_from_suite(suite, agent, num_tasks=64), vocab_size=args.vocab_size)
    spec = TinyModelSpec(hidden_size=args.hidden_size, num_layers=args.num_layers, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=2 * args.hidden_size, vocab_size=args.vocab_size)
    model = build_tiny_model(spec, tokenizer, seed=args.seed).to(args.device)
    compiled = {"decode": "fused_compiled"} if args.fused_compile else {}
    engine = HFEngine(model, tokenizer, max_batch_size=max(args.batches), prefix_cache=not args.no_prefix_cache, **compiled)
    calls = timed_generate(engine)
    loop = AgentLoop(suite, engine, tokenizer, agent)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    tasks = [suite.train_task(i) for i in range(args.episodes)]
    sft = warm_start(model, loop, suite, args.sft_steps, args.sft_lr, args.seed) if args.sft_steps else None
    if sft:
        print(f"warm start: {json.dumps(sft)}", flush=True)

    play(loop, engine, calls, tasks[:1], 1, params, args.seed)  # warm-up
    figures: dict[str, float] = {}
    passes: dict[int, list[dict]] = {batch: [] for batch in args.batches}
    for _ in range(args.repeats):
        for batch in args.batches:
            passes[batch].append(play(loop, engine, calls, tasks, batch, params, args.seed))
    runs = {}
    for batch in args.batches:
        r = sorted(passes[batch], key=lambda p: p["wall_s"])[len(passes[batch]) // 2]
        r["wall_s_all_passes"] = [p["wall_s"] for p in passes[batch]]
        runs[batch] = r
        figures[f"episodes_per_s_batch{batch}"] = r["episodes"] / r["wall_s"]
        figures[f"env_steps_per_s_batch{batch}"] = r["turns"] / r["wall_s"]
        figures[f"env_calls_per_s_batch{batch}"] = r["env_calls"] / r["wall_s"]
        figures[f"generated_tokens_per_s_batch{batch}"] = r["generated_tokens"] / r["wall_s"]
        figures[f"generate_time_fraction_batch{batch}"] = r["generate_s"] / r["wall_s"]
        figures[f"other_s_per_turn_batch{batch}"] = (r["wall_s"] - r["generate_s"]) / r["turns"]
        figures[f"generate_s_per_call_batch{batch}"] = r["generate_s"] / r["generate_calls"]
        figures[f"cpu_s_per_wall_s_batch{batch}"] = r["cpu_s"] / r["wall_s"]
        figures[f"prompt_tokens_per_turn_batch{batch}"] = r["prompt_tokens"] / r["turns"]
        figures[f"padding_fraction_batch{batch}"] = 1 - r["prompt_tokens"] / r["padded_prompt_tokens"]
        figures[f"prefix_cache_hit_rate_batch{batch}"] = r["prefix_cache_hit_rate"]
        print(f"batch {batch}: {json.dumps({k: v for k, v in r.items()})}", flush=True)
    first, last = min(args.batches), max(args.batches)
    figures[f"speedup_{last}_vs_{first}"] = figures[f"env_steps_per_s_batch{last}"] / figures[f"env_steps_per_s_batch{first}"]
    figures[f"episodes_speedup_{last}_vs_{first}"] = (
        figures[f"episodes_per_s_batch{last}"] / figures[f"episodes_per_s_batch{first}"]
    )

    result = {
        "benchmark": "agent_loop_throughput",
        "figures": figures,
        "config": {
            "suite": {"class": "ProceduralWorldSuite", "difficulty": args.difficulty, "max_turns": suite.max_turns},
            "engine": "hf",
            "repo": str(Path(r3lightning.__file__).resolve().parents[1]),
            "prefix_cache": not args.no_prefix_cache,
            "fused_compile": args.fused_compile,
            **({"compile": engine.compile_stats()} if args.fused_compile else {}),
            "device": args.device,
            "model": {**spec.__dict__, "params": count_parameters(model)},
            "warm_start": sft,
            "torch_threads": torch.get_num_threads(),
            "batches": args.batches,
            "episodes_per_batch_size": args.episodes,
            "sampling": {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens},
            "agent_loop": agent.__dict__,
            "runs": {str(b): r for b, r in runs.items()},
            "env_steps_definition": "agent turns (each counts toward the step limit); env_calls: turns whose "
                                    "response parsed to an action and reached Environment.step",
            "statistic": f"median of {args.repeats} timed passes per batch size (interleaved), after one warm-up episode",
        },
        "machine": machine_info(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
