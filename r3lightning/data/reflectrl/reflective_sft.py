"""ReflectRL's stage-1 data (docs/reflectrl.md): chat rows for the SFT head, built from a GNT pool.

- A GT+ row (the expert was right) trains as plain SFT: the question, then the expert's answer.
- A GNT row becomes a reflective row: the reflective prompt (the question and the wrong answer,
  ``envs.reflective.reflective_prompt``) then a critique that names the wrong step, corrects it and
  ends in ``\\boxed{answer}``. Critiques come from a critic: a model shown the reflective prompt
  (``model_critiques``), a model that answers the question again, its answer turned into a critique
  of the GNT's first differing step (``resolved_critiques``), or a suite's scripted critic, an oracle
  (``scripted_critiques``). One is kept only when its final answer verifies (``keep_verified``),
  which gives ``reflect_sft/critique_verified_rate``.

The rows are ``{"messages": [system, user, assistant], "kind": "gt_plus"|"reflective", "provenance": {...}}``,
what ``model.phases.warmstart.demos.source`` reads (``load_chat_jsonl``; the extra keys are ignored there). File
demonstrations are taken in file order, so ``build_sft_rows`` shuffles them once with a seed: every
warm-start step then mixes both kinds.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

from r3lightning.envs.base import Task, TaskSuite
from r3lightning.envs.math_env import extract_answer
from r3lightning.envs.reflective import (
    DEFAULT_REFLECTIVE_TEMPLATE,
    LABEL_GNT,
    LABEL_GT_PLUS,
    answer_reader,
    pool_task,
    reflective_prompt,
)
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.engines.base import SamplingParams

Verify = Callable[[dict[str, Any], str], bool]
"""``(pool row, response text) -> whether the response's final answer is right for the row's task``."""


def _chat(system_prompt: str, user: str, assistant: str) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return head + [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def _provenance(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("task_id", "split", "index", "expert", "engine", "sampling", "sample", "reward", "source")
    return {k: row[k] for k in keys if k in row}


def gt_plus_row(row: dict[str, Any], system_prompt: str) -> dict[str, Any]:
    """Plain SFT row of a GT+ pool row: [system], the question as the expert saw it, its answer."""
    return {"messages": _chat(system_prompt, row["prompt"], row["response"]), "kind": "gt_plus", "provenance": _provenance(row)}


def reflective_row(
    row: dict[str, Any], critique: str, system_prompt: str, template: str = DEFAULT_REFLECTIVE_TEMPLATE, critic: str = ""
) -> dict[str, Any]:
    """Reflective SFT row of a GNT pool row: [system], the reflective prompt (question + GNT), then
    ``critique`` (wrong step, correction, boxed answer)."""
    prompt = reflective_prompt(row["prompt"], row["response"], template)
    return {
        "messages": _chat(system_prompt, prompt, critique),
        "kind": "reflective",
        "provenance": {**_provenance(row), "critic": critic},
    }


def suite_verifier(suite: TaskSuite) -> Verify:
    """``Verify`` by ``suite``'s own environment (the pool's verifier): reset with the row's task, step once."""
    from r3lightning.data.reflectrl.gnt_pool import verify_response

    def verify(row: dict[str, Any], response: str) -> bool:
        _, success, _, failed = verify_response(suite, pool_task(row), response)
        return success and not failed

    return verify


def keep_verified(
    candidates: list[tuple[dict[str, Any], list[str]]], verify: Verify
) -> tuple[list[tuple[dict[str, Any], str]], float]:
    """For each (GNT row, candidate critiques): the first critique whose final answer verifies, if any.

    Returns ([(row, kept critique)], verified rate = verified candidates / all candidates, 0 when
    there are none). Candidates after the first verified one are not checked."""
    kept: list[tuple[dict[str, Any], str]] = []
    checked = verified = 0
    for row, critiques in candidates:
        for critique in critiques:
            checked += 1
            if critique and verify(row, critique):
                verified += 1
                kept.append((row, critique))
                break
    return kept, (verified / checked if checked else 0.0)


def scripted_critiques(rows: list[dict[str, Any]], critic: Callable[[Task, str], Optional[str]]) -> list[list[str]]:
    """One candidate per GNT row from a scripted ``critic`` (``(direct task, wrong response) -> text``);
    an empty list where it has none to give."""
    out = []
    for row in rows:
        text = critic(pool_task(row), row["response"])
        out.append([text] if text else [])
    return out


def model_critiques(
    loop: AgentLoop, rows: list[dict[str, Any]], template: str, samples: int, params: SamplingParams
) -> list[list[str]]:
    """``samples`` critiques per GNT row from the model behind ``loop`` (seed torch's RNG first): it is
    shown the reflective prompt, with the loop's suite's system prompt, and its whole answer is the
    candidate critique."""
    tasks = [
        Task(row["task_id"], reflective_prompt(row["prompt"], row["response"], template), row["answer"], {"question": row["question"]})
        for row in rows
    ]
    trajectories = loop.run([EpisodeRequest(task=t) for t in tasks for _ in range(samples)], params)
    texts = [loop.tokenizer.decode([tok for turn in t.turns for tok in turn.response_ids], skip_special_tokens=True) for t in trajectories]
    return [texts[i * samples : (i + 1) * samples] for i in range(len(rows))]


def _steps(text: str) -> list[str]:
    """The non-empty lines of an answer before its ``\\boxed{}`` line, stripped."""
    return [line.strip() for line in text.strip().splitlines() if line.strip() and "\\boxed" not in line]


def resolve_critique(wrong_response: str, solution: str) -> Optional[str]:
    """A critique of ``wrong_response`` (str, a GNT written step per line) made from ``solution`` (str,
    another answer to the same question, step per line, ending in ``\\boxed{}``), in the oracle's format
    (``Wrong step: ... / Correction: a; b / \\boxed{c}``), or None when ``solution`` has no final answer.

    The wrong step is the GNT's first line that is not the solution's line at the same place (its
    boxed line when every step agrees); the correction is the solution's steps from that place on.
    Nothing here knows the reference answer: a critique is only as right as ``solution``
    (``keep_verified`` then keeps verified ones)."""
    answer = extract_answer(solution)
    if answer is None:
        return None
    wrong, right = _steps(wrong_response), _steps(solution)
    place = next((i for i, (w, r) in enumerate(zip(wrong, right)) if w != r), min(len(wrong), len(right)))
    if place < len(wrong):
        wrong_step = wrong[place]
    else:
        boxed = [line.strip() for line in wrong_response.splitlines() if "\\boxed" in line]
        wrong_step = boxed[-1] if boxed else "no final answer"
    correction = "; ".join(right[min(place, max(len(right) - 1, 0)) :]) or f"\\boxed{{{answer}}}"
    return f"Wrong step: {wrong_step}\nCorrection: {correction}\n\\boxed{{{answer}}}"


REFLECTIVE_TARGETS = ("critique", "solution")
"""What a reflective row's target is: ``critique`` (``Wrong step: ... / Correction: ... / \\boxed{}``) or
``solution`` (the corrected answer in the direct answers' format, so that the context-distillation
teacher, asked under the reflective prompt, writes what the direct student writes: its KL then carries
content, not format; docs/reflectrl.md, "The reflective target")."""


def resolve_candidate(
    wrong_response: str, solution: str, target: str = "critique", read_answer: Callable[[str], Optional[str]] = extract_answer
) -> Optional[str]:
    """The reflective target that the re-solved answer ``solution`` (str) makes for the GNT
    ``wrong_response`` (str): ``resolve_critique`` for ``critique``; for ``solution``, the answer itself,
    stripped (it is a direct answer to the same question). None when ``solution`` has no final answer
    (``read_answer``: the suite's reader, ``\\boxed{}`` by default; ``answer_reader``)."""
    if target not in REFLECTIVE_TARGETS:
        raise ValueError(f"reflective target must be one of {REFLECTIVE_TARGETS}, got {target!r}")
    if target == "solution":
        return solution.strip() if read_answer(solution) is not None else None
    return resolve_critique(wrong_response, solution)


def resolved_critiques(
    loop: AgentLoop, rows: list[dict[str, Any]], samples: int, params: SamplingParams, target: str = "critique"
) -> list[list[str]]:
    """``samples`` candidate reflective targets per GNT row from the model behind ``loop``: it answers the
    row's *direct* question (no GNT, no reference answer), and each answer becomes
    ``resolve_candidate(GNT, answer, target)`` read by the loop's suite. The non-oracle critic for a model
    that cannot follow the reflective prompt (a tiny expert never trained on it writes no verified
    critique from it)."""
    trajectories = loop.run([EpisodeRequest(task=pool_task(row)) for row in rows for _ in range(samples)], params)
    texts = [loop.tokenizer.decode([tok for turn in t.turns for tok in turn.response_ids], skip_special_tokens=True) for t in trajectories]
    read = answer_reader(loop.suite)
    out = []
    for i, row in enumerate(rows):
        critiques = (resolve_candidate(row["response"], text, target, read) for text in texts[i * samples : (i + 1) * samples])
        out.append([c for c in critiques if c])
    return out


def build_sft_rows(
    pool: list[dict[str, Any]],
    critiques: list[list[str]],
    verify: Verify,
    system_prompt: str,
    template: str = DEFAULT_REFLECTIVE_TEMPLATE,
    gt_plus: bool = True,
    reflective: bool = True,
    seed: int = 0,
    critic: str = "",
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Stage-1 SFT rows from the *training* rows of a pool (validation rows are never trained on).

    pool: pool rows (``label``, ``split``...); critiques: candidate critiques per training GNT row, in
    pool order (``scripted_critiques`` / ``model_critiques``), ignored unless ``reflective``.
    Returns (rows shuffled with ``seed``, stats): ``reflect_sft/critique_verified_rate``,
    ``reflect_sft/gnt_rows``, ``reflect_sft/reflective_rows``, ``reflect_sft/gt_plus_rows``, ``reflect_sft/rows``.
    """
    train = [r for r in pool if r["split"] == "train"]
    gnt = [r for r in train if r["label"] == LABEL_GNT]
    rows = [gt_plus_row(r, system_prompt) for r in train if r["label"] == LABEL_GT_PLUS] if gt_plus else []
    stats = {"reflect_sft/gnt_rows": float(len(gnt)), "reflect_sft/gt_plus_rows": float(len(rows))}
    if reflective:
        if len(critiques) != len(gnt):
            raise ValueError(f"reflective SFT: {len(critiques)} critique lists for {len(gnt)} GNT rows")
        kept, rate = keep_verified(list(zip(gnt, critiques)), verify)
        rows += [reflective_row(r, c, system_prompt, template, critic) for r, c in kept]
        stats["reflect_sft/critique_verified_rate"] = rate
        stats["reflect_sft/reflective_rows"] = float(len(kept))
    random.Random(seed).shuffle(rows)
    stats["reflect_sft/rows"] = float(len(rows))
    if not rows:
        raise ValueError("reflective SFT: no rows (no GT+ rows, and no GNT row got a verified critique)")
    return rows, stats


def training_gnt_rows(pool: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GNT rows of split ``train``, in pool order (the rows critiques are made for)."""
    return [r for r in pool if r["split"] == "train" and r["label"] == LABEL_GNT]
