"""``r3l gnt-pool`` and ``r3l reflect-sft``: build ReflectRL's golden-negative pool and its stage-1 SFT
file (docs/reflectrl.md). Both read the suite (and its agent and sampling settings) from the same
recipe ``r3l fit`` uses, so the pool, the SFT rows and the training run agree on prompts, system
prompt and verifier. The data they write is made by ``r3lightning.data.reflectrl``; the expert or critic
is loaded by ``r3lightning.checkpointing.export.load_policy`` (an r3lightning checkpoint or a Hugging
Face model directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Optional

import torch
import yaml

from r3lightning.checkpointing.export import load_policy
from r3lightning.cli.config_yaml import check_no_duplicate_keys
from r3lightning.data.reflectrl.gnt_pool import PoolStats, build_pool, direct_suite, expert_rollouts, read_rollouts, write_jsonl
from r3lightning.data.reflectrl.reflective_sft import (
    build_sft_rows,
    model_critiques,
    REFLECTIVE_TARGETS,
    resolved_critiques,
    scripted_critiques,
    suite_verifier,
    training_gnt_rows,
)
from r3lightning.envs.base import TaskSuite
from r3lightning.envs.reflective import DEFAULT_REFLECTIVE_TEMPLATE, ReflectiveSuite, read_pool, scripted_critic
from r3lightning.rollout.agent_loop import AgentLoop, AgentLoopConfig
from r3lightning.engines.base import SamplingParams
from r3lightning.engines.config import EngineConfig, build_engine

MAX_MESSAGES = 5
"""Skipped-row messages printed in full; the rest are counted."""


def recipe_sections(path: str) -> dict[str, Any]:
    """The ``data`` section of a recipe YAML (``data.suite`` required). Raises ValueError naming the file."""
    if not os.path.isfile(path):
        raise ValueError(f"--config: no such file {path!r}")
    with open(path) as handle:
        text = handle.read()
    config = yaml.safe_load(text) or {}
    check_no_duplicate_keys(text, f"--config {path!r}")
    data = config.get("data") or {}
    if "suite" not in data:
        raise ValueError(f"--config {path!r}: no data.suite section")
    return data


def build_suite(spec: dict[str, Any]) -> TaskSuite:
    """Instantiate a ``class_path``/``init_args`` suite spec exactly as ``r3l fit`` would."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--suite", type=TaskSuite)
    return parser.instantiate(parser.parse_object({"suite": spec})).suite


def _agent(data: dict[str, Any]) -> AgentLoopConfig:
    return AgentLoopConfig(**(data.get("agent") or {}))


def _sampling(data: dict[str, Any], args: argparse.Namespace) -> SamplingParams:
    base = SamplingParams(**(data.get("sampling") or {}))
    return SamplingParams(
        temperature=base.temperature if args.temperature is None else args.temperature,
        top_p=base.top_p if args.top_p is None else args.top_p,
        max_new_tokens=base.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        stop=list(base.stop),
    )


def _loop(suite: TaskSuite, model: str, backend: str, agent: AgentLoopConfig, batch: int) -> AgentLoop:
    policy, tokenizer = load_policy(model)
    policy.eval()
    model_path = model if backend == "vllm" and os.path.isdir(model) else ""
    engine = build_engine(EngineConfig(backend=backend, max_batch_size=batch, model_path=model_path), policy, tokenizer)
    return AgentLoop(suite, engine, tokenizer, agent)


def _print_dropped(command: str, messages: list[str]) -> None:
    for message in messages[:MAX_MESSAGES]:
        print(f"r3l {command}: {message}", file=sys.stderr)
    if len(messages) > MAX_MESSAGES:
        print(f"r3l {command}: ... and {len(messages) - MAX_MESSAGES} more dropped rows", file=sys.stderr)


def by_reason(counts: dict[str, int]) -> str:
    """``"3 (invalid_json 2, not_utf8 1)"``: a total and its reasons."""
    total = sum(counts.values())
    return f"{total} ({', '.join(f'{reason} {n}' for reason, n in sorted(counts.items()))})" if total else "0"


def _bounded(kind: type, low: float, high: float = float("inf"), low_open: bool = False) -> Callable[[str], Any]:
    """An argparse ``type`` accepting a ``kind`` in [low, high] ((low, high] when ``low_open``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if value < low or (low_open and value == low) or value > high:
            low_side = f"> {low:g}" if low_open else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {low_side}" + (f" and <= {high:g}" if high != float("inf") else "") + f", got {text}")
        return value
    return parse


COUNT, NON_NEGATIVE = _bounded(int, 1), _bounded(int, 0)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe YAML whose data.suite (data.agent, data.sampling) is used")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout engine of the model (default hf)")
    parser.add_argument("--temperature", type=_bounded(float, 0.0), default=None, help="sampling temperature (default: data.sampling's)")
    parser.add_argument("--top_p", type=_bounded(float, 0.0, 1.0, low_open=True), default=None, help="nucleus mass (default: data.sampling's)")
    parser.add_argument("--max_new_tokens", type=COUNT, default=None, help="tokens per answer (default: data.sampling's)")
    parser.add_argument("--batch_size", type=COUNT, default=256, help="prompts per generate call")
    parser.add_argument("--seed", type=int, default=0, help="seeds sampling (and the SFT rows' shuffle)")


def gnt_pool_main(argv: list[str]) -> dict[str, Any]:
    """``r3l gnt-pool --config RECIPE (--expert MODEL | --rollouts FILE) --out POOL.jsonl``; returns the summary."""
    parser = argparse.ArgumentParser(
        prog="r3l gnt-pool",
        description="Run an expert on a suite's training tasks (or read its rollouts), verify every answer, "
        "and write GT+ (correct) and GNT (wrong) rows with provenance.",
    )
    _common(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--expert", help="r3lightning checkpoint (.ckpt), GGUF file (a path or package/file.gguf) or Hugging Face model directory/id")
    source.add_argument("--rollouts", help="JSONL of existing expert rollouts: prompt, answer, response (+ task_id, split, question)")
    parser.add_argument("--num_tasks", type=COUNT, default=512, help="training tasks 0..N-1 the expert answers")
    parser.add_argument("--samples", type=COUNT, default=4, help="answers per training task")
    parser.add_argument("--val_samples", type=NON_NEGATIVE, default=4, help="answers per validation task (their GNTs are shown in reflective validation; 0: none)")
    parser.add_argument("--max_reward", type=_bounded(float, 0.0, low_open=True), default=1.0, help="reward of a full success (data.max_reward)")
    parser.add_argument("--out", required=True, help="pool JSONL to write; the summary goes to <out>.summary.json")
    args = parser.parse_args(argv)
    data = recipe_sections(args.config)
    suite = direct_suite(build_suite(data["suite"]))
    stats = PoolStats()
    if args.rollouts:
        rows = read_rollouts(args.rollouts, stats)
    else:
        params = _sampling(data, args)
        loop = _loop(suite, args.expert, args.engine, _agent(data), args.batch_size)
        tasks = [("train", i, suite.train_task(i)) for i in range(args.num_tasks)]
        torch.manual_seed(args.seed)
        rows = expert_rollouts(loop, tasks, args.samples, params, args.expert, args.engine)
        if args.val_samples > 0:
            val = [("val", i, t) for i, t in enumerate(suite.val_tasks())]
            rows += expert_rollouts(loop, val, args.val_samples, params, args.expert, args.engine)
    pool, summary = build_pool(rows, suite, stats, args.max_reward)
    _print_dropped("gnt-pool", stats.messages)
    if not pool:
        source = f"--rollouts {args.rollouts!r}" if args.rollouts else f"--expert {args.expert!r}"
        raise ValueError(f"{source}: no row to write to the pool ({stats.rows} rows read, skipped {by_reason(stats.skipped)})")
    write_jsonl(args.out, pool)
    summary["config"] = {k: v for k, v in vars(args).items()}
    with open(f"{args.out}.summary.json", "w") as handle:
        json.dump(summary, handle, indent=2)
    print(
        f"r3l gnt-pool: wrote {args.out}: gnt/count {summary['gnt/count']}, gt_plus/count {summary['gt_plus/count']}, "
        f"gnt/expert_accuracy {summary['gnt/expert_accuracy']:.3f}, skipped {by_reason(stats.skipped)}"
    )
    return summary


def reflect_sft_main(argv: list[str]) -> dict[str, Any]:
    """``r3l reflect-sft --config RECIPE --pool POOL.jsonl --out SFT.jsonl [--critic model|resolve|oracle]``; returns the stats."""
    parser = argparse.ArgumentParser(
        prog="r3l reflect-sft",
        description="Build ReflectRL's stage-1 SFT file from a GNT pool: GT+ rows as plain SFT, GNT rows as "
        "(reflective prompt -> verified critique + correction + boxed answer).",
    )
    _common(parser)
    parser.add_argument("--pool", required=True, help="pool JSONL written by r3l gnt-pool")
    parser.add_argument("--out", required=True, help="chat JSONL to write (model.phases.warmstart.demos.source); stats go to <out>.summary.json")
    parser.add_argument(
        "--critic", choices=("model", "resolve", "oracle"), default="model",
        help="who writes critiques: model (default: the pool's expert, or --critic_model, samples them from the "
        "reflective prompt), resolve (that model answers the question again and its answer corrects the GNT from its "
        "first differing step: for a model that cannot follow the reflective prompt), neither reading the reference "
        "answer; or oracle (the suite's scripted critic, which knows the reference answer and the derivation)",
    )
    parser.add_argument("--critic_model", default=None, help="critic checkpoint, GGUF file or model directory (default: the pool's expert)")
    parser.add_argument("--critic_samples", type=COUNT, default=4, help="critiques sampled per GNT (model and resolve critics); the first that verifies is kept")
    parser.add_argument(
        "--target", choices=REFLECTIVE_TARGETS, default="critique",
        help="a reflective row's target: critique (Wrong step / Correction / boxed answer) or solution (the corrected "
        "answer in the direct answers' format, so the context-distillation teacher's KL carries content, not format; "
        "resolve and oracle critics)",
    )
    parser.add_argument("--no_reflective", action="store_true", help="GT+ rows only (the 'GT+ only' baseline's SFT data)")
    parser.add_argument("--no_gt_plus", action="store_true", help="reflective rows only")
    args = parser.parse_args(argv)
    if args.target == "solution" and args.critic == "model" and not args.no_reflective:
        raise ValueError("--target solution: the model critic writes its own format; use --critic resolve or oracle")
    data = recipe_sections(args.config)
    configured = build_suite(data["suite"])
    suite = direct_suite(configured)
    template = configured.template if isinstance(configured, ReflectiveSuite) else DEFAULT_REFLECTIVE_TEMPLATE
    dropped: dict[str, list[str]] = {}
    pool = read_pool(args.pool, dropped)
    _print_dropped("reflect-sft", [m for messages in dropped.values() for m in messages])
    counts = {reason: len(messages) for reason, messages in dropped.items()}
    if not pool:
        raise ValueError(f"--pool {args.pool!r}: no usable row (dropped {by_reason(counts)})")
    gnt = training_gnt_rows(pool)
    critiques: list[list[str]] = []
    critic_name = ""
    if not args.no_reflective:
        if args.critic == "oracle":
            critic = scripted_critic(suite, args.target)
            if critic is None:
                raise ValueError(f"--critic oracle: {type(suite).__name__} has no scripted critic for --target {args.target}; use --critic model")
            critiques, critic_name = scripted_critiques(gnt, critic), "oracle"
        else:
            critic_name = args.critic_model or _pool_expert(pool, args.pool)
            loop = _loop(suite, critic_name, args.engine, _agent(data), args.batch_size)
            torch.manual_seed(args.seed)
            if args.critic == "resolve":
                critiques = resolved_critiques(loop, gnt, args.critic_samples, _sampling(data, args), args.target)
                critic_name = f"resolve:{critic_name}"
            else:
                critiques = model_critiques(loop, gnt, template, args.critic_samples, _sampling(data, args))
    rows, stats = build_sft_rows(
        pool, critiques, suite_verifier(suite), suite.system_prompt, template,
        gt_plus=not args.no_gt_plus, reflective=not args.no_reflective, seed=args.seed, critic=critic_name,
    )
    write_jsonl(args.out, rows)
    summary = {**stats, "reflect_sft/dropped": counts, "config": vars(args)}
    with open(f"{args.out}.summary.json", "w") as handle:
        json.dump(summary, handle, indent=2)
    rate = stats.get("reflect_sft/critique_verified_rate")
    print(
        f"r3l reflect-sft: wrote {args.out}: {int(stats['reflect_sft/rows'])} rows "
        f"({int(stats['reflect_sft/gt_plus_rows'])} GT+, {int(stats.get('reflect_sft/reflective_rows', 0))} reflective"
        + (f"; reflect_sft/critique_verified_rate {rate:.3f}" if rate is not None else "")
        + f"; dropped {by_reason(counts)})"
    )
    return summary


def _pool_expert(pool: list[dict[str, Any]], path: str) -> str:
    experts = sorted({r.get("expert", "") for r in pool} - {""})
    if len(experts) != 1:
        raise ValueError(f"--critic model: give --critic_model (the pool {path!r} names {len(experts)} experts)")
    return experts[0]


def main(command: str, argv: list[str]) -> Optional[dict[str, Any]]:
    """Run ``r3l gnt-pool`` or ``r3l reflect-sft``; bad input exits with status 2 and a one-line message."""
    run = {"gnt-pool": gnt_pool_main, "reflect-sft": reflect_sft_main}[command]
    try:
        return run(argv)
    except (ValueError, OSError) as err:
        print(f"r3l {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
