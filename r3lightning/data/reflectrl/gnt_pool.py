"""The golden-negative pool (ReflectRL, docs/reflectrl.md): an expert's rollouts on a suite's tasks,
verified and split into GT+ (correct) and GNT (wrong, with the full reasoning) rows.

``r3l gnt-pool`` runs an expert (``expert_rollouts``) or reads a JSONL of its rollouts
(``read_rollouts``), verifies every response with the suite's own environment (``verify_rollouts``),
labels the rows (``label_rows``) and writes one JSONL with provenance (``write_jsonl``) plus a summary
(``pool_summary``: ``gnt/count``, ``gnt/expert_accuracy``). Bad rows (missing fields, no parseable
answer, a verifier failure) are counted and skipped with a message naming the file and row.

A rollout row is a dict: ``task_id``, ``split`` (``train``/``val``), ``index`` (task index or None),
``question``, ``prompt`` (the user message the expert answered), ``answer`` (the reference),
``response`` (the expert's whole answer) and provenance: ``expert``, ``engine``, ``sampling``,
``sample`` (sample number for the task), ``source``. Verification adds ``reward``, ``success`` and
``extracted_answer``; labelling adds ``label`` (``gnt`` or ``gt_plus``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from r3lightning.envs.base import Task, TaskSuite
from r3lightning.envs.jsonl import utf8_lines
from r3lightning.envs.reflective import LABEL_GNT, LABEL_GT_PLUS, ReflectiveSuite
from r3lightning.rollout.agent_loop import AgentLoop, EpisodeRequest
from r3lightning.rollout.env_calls import SuiteCalls
from r3lightning.engines.base import SamplingParams

REQUIRED_FIELDS = ("prompt", "answer", "response")
"""Fields a rollout row read from a file must have (non-empty strings)."""

STEP_TIMEOUT_S = 30.0
"""Deadline of one verification (the agent loop's default ``step_timeout_s``); a row past it is skipped."""


@dataclass
class PoolStats:
    """Counts of one pool build. ``skipped`` maps a reason to its count; ``messages`` names each
    skipped row (file and row, or task id and sample)."""

    rows: int = 0
    gnt: int = 0
    gt_plus: int = 0
    unparseable: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)

    def skip(self, reason: str, message: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.messages.append(message)


# ---- reading and generating rollouts ---------------------------------------------------------------
def direct_suite(suite: TaskSuite) -> TaskSuite:
    """The suite the expert answers: a ``ReflectiveSuite``'s wrapped suite, else ``suite`` itself."""
    return suite.suite if isinstance(suite, ReflectiveSuite) else suite


def read_rollouts(path: str, stats: PoolStats) -> list[dict[str, Any]]:
    """Rollout rows of a JSONL file (list of dicts): each row needs ``prompt``, ``answer`` and
    ``response``; ``task_id`` defaults to ``<file>#row<n>``, ``split`` to ``train``, ``question`` to the
    prompt. Rows that are not UTF-8, not JSON objects, lack a field or name a split other than
    ``train``/``val`` are counted in ``stats`` and skipped with a message naming ``path`` and the 1-based
    row. Raises FileNotFoundError naming ``path``, ValueError when it has no rows at all."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"gnt-pool: no such rollouts file {path!r}")
    rows = []
    name = os.path.basename(path)
    lines = 0
    for number, line, problem in utf8_lines(path):
        where = f"{path}, row {number}"
        if problem:
            lines += 1
            stats.skip("not_utf8", f"{where}: {problem}; skipped")
            continue
        if not line.strip():
            continue
        lines += 1
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            stats.skip("invalid_json", f"{where}: not valid JSON ({err.msg}); skipped")
            continue
        if not isinstance(row, dict):
            stats.skip("not_an_object", f"{where}: not a JSON object; skipped")
            continue
        missing = [f for f in REQUIRED_FIELDS if not isinstance(row.get(f), str) or not row[f].strip()]
        if missing:
            stats.skip("missing_field", f"{where}: missing field {missing[0]!r}; skipped")
            continue
        if "split" in row and row["split"] not in ("train", "val"):
            stats.skip("unknown_split", f"{where}: unknown split {row['split']!r} (not 'train' or 'val'); skipped")
            continue
        rows.append(
            {
                "task_id": str(row.get("task_id") or f"{name}#row{number}"),
                "split": row.get("split", "train"),
                "index": row.get("index"),
                "question": str(row.get("question") or row["prompt"]),
                "prompt": row["prompt"],
                "answer": row["answer"],
                "response": row["response"],
                "expert": row.get("expert", ""),
                "engine": row.get("engine", ""),
                "sampling": row.get("sampling", {}),
                "sample": row.get("sample", 0),
                "source": f"{path}:row {number}",
            }
        )
    if not lines:
        raise ValueError(f"the rollouts file {path!r} is empty")
    return rows


def expert_rollouts(
    loop: AgentLoop,
    tasks: list[tuple[str, Optional[int], Task]],
    samples: int,
    params: SamplingParams,
    expert: str,
    engine: str,
) -> list[dict[str, Any]]:
    """Rollout rows of the expert behind ``loop``: ``samples`` answers to each ``(split, index, task)``,
    sampled with ``params`` (torch's global RNG: seed it first). ``response`` is the decoded text of the
    whole answer (every response token, special tokens dropped), so a GNT keeps its full reasoning."""
    requests = [EpisodeRequest(task=task) for _, _, task in tasks for _ in range(samples)]
    trajectories = loop.run(requests, params)
    rows = []
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "max_new_tokens": params.max_new_tokens}
    for k, trajectory in enumerate(trajectories):
        split, index, task = tasks[k // samples]
        response_ids = [tok for turn in trajectory.turns for tok in turn.response_ids]
        rows.append(
            {
                "task_id": task.task_id,
                "split": split,
                "index": index,
                "question": str(task.data.get("question") or task.prompt),
                "prompt": task.prompt,
                "answer": task.answer,
                "response": loop.tokenizer.decode(response_ids, skip_special_tokens=True),
                "expert": expert,
                "engine": engine,
                "sampling": sampling,
                "sample": k % samples,
                "source": "generated",
            }
        )
    return rows


# ---- verification and labels -----------------------------------------------------------------------
def verify_response(
    suite: TaskSuite, task: Task, response: str, timeout_s: Optional[float] = STEP_TIMEOUT_S
) -> tuple[float, bool, Optional[str], bool]:
    """(reward, success, extracted answer, verifier failed) of ``response`` (str) to ``task`` by the
    suite's own environment: a fresh one is reset with the task and stepped once, the step under a
    deadline of ``timeout_s`` seconds (``SuiteCalls``: ``EnvCallError`` when it raises, hangs or returns a malformed result). The extracted answer is the
    environment's ``info["extracted_answer"]`` (math suites), or the response itself for environments
    that do not report one; None means no answer could be parsed."""
    calls = SuiteCalls(suite, timeout_s, "gnt-pool verification")
    env = suite.make_env()
    calls.reset(env, task)
    result = calls.step(env, task, response)
    extracted = result.info["extracted_answer"] if "extracted_answer" in result.info else response
    success = bool(result.info.get("success", result.reward >= 1.0))
    return float(result.reward), success, extracted, bool(result.info.get("reward_error"))


def verify_rollouts(
    rows: list[dict[str, Any]], suite: TaskSuite, stats: PoolStats, timeout_s: Optional[float] = STEP_TIMEOUT_S
) -> list[dict[str, Any]]:
    """The rows with ``reward``, ``success`` and ``extracted_answer`` added (new dicts). Rows whose answer
    cannot be parsed, or whose verification failed, are counted in ``stats`` and left out (an
    unparseable answer still counts as a failure of the expert in ``gnt/expert_accuracy``). A verification
    that raises or misses its deadline of ``timeout_s`` seconds counts as a verifier failure."""
    verified = []
    for row in rows:
        stats.rows += 1
        where = row["source"] if row["source"] != "generated" else f"task {row['task_id']}, sample {row['sample']}"
        task = Task(task_id=row["task_id"], prompt=row["prompt"], answer=row["answer"], data={"question": row["question"]})
        try:
            reward, success, extracted, failed = verify_response(suite, task, row["response"], timeout_s)
        except Exception as err:  # an environment that cannot take the row (bad reference answer...)
            stats.skip("verifier_error", f"{where}: the verifier failed ({type(err).__name__}: {err}); skipped")
            continue
        if failed:
            stats.skip("verifier_error", f"{where}: the verifier failed; skipped")
            continue
        if extracted is None:
            stats.unparseable += 1
            stats.skip("unparseable_answer", f"{where}: no parseable final answer; skipped")
            continue
        verified.append({**row, "reward": reward, "success": success, "extracted_answer": extracted})
    return verified


def label_rows(rows: list[dict[str, Any]], max_reward: float, stats: PoolStats) -> list[dict[str, Any]]:
    """Verified rows labelled ``gt_plus`` (success, or reward >= ``max_reward``) or ``gnt`` (the rest),
    in order; counts go to ``stats``."""
    labelled = []
    for row in rows:
        correct = row["success"] or row["reward"] >= max_reward
        label = LABEL_GT_PLUS if correct else LABEL_GNT
        stats.gt_plus += int(correct)
        stats.gnt += int(not correct)
        labelled.append({"label": label, **row})
    return labelled


def pool_summary(rows: list[dict[str, Any]], stats: PoolStats) -> dict[str, Any]:
    """The figures ``r3l gnt-pool`` reports: ``gnt/count``, ``gt_plus/count``, ``gnt/expert_accuracy``
    (correct / verified-or-unparseable rows: an answer the verifier cannot parse is the expert's
    failure), per split, and the skipped rows by reason."""
    summary: dict[str, Any] = {
        "gnt/count": stats.gnt,
        "gt_plus/count": stats.gt_plus,
        "gnt/expert_accuracy": stats.gt_plus / max(stats.gt_plus + stats.gnt + stats.unparseable, 1),
        "gnt/rows_read": stats.rows,
        "gnt/skipped": dict(stats.skipped),
    }
    for split in ("train", "val"):
        part = [r for r in rows if r["split"] == split]
        if part:
            summary[f"gnt/count_{split}"] = sum(r["label"] == LABEL_GNT for r in part)
            summary[f"gt_plus/count_{split}"] = sum(r["label"] == LABEL_GT_PLUS for r in part)
            summary[f"gnt/tasks_with_gnt_{split}"] = len({r["task_id"] for r in part if r["label"] == LABEL_GNT})
    return summary


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    """One JSON object per line (parent directories created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_pool(
    rows: list[dict[str, Any]], suite: TaskSuite, stats: PoolStats, max_reward: float = 1.0
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(labelled pool rows, summary) of rollout ``rows`` on ``suite``: verify, label, summarize."""
    pool = label_rows(verify_rollouts(rows, suite, stats), max_reward, stats)
    return pool, pool_summary(pool, stats)
