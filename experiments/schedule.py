"""Run an experiment's jobs over the machine's cores: each job takes as many cores as it runs torch
threads, and a job starts as soon as its cores are free and the job it needs has finished.

A tiny policy's matmuls are too small for a second thread to pay (two 1-thread runs side by side get
more done than one 2-thread run), and a run's results depend on its thread count, not on what runs
beside it, so a comparison scheduled this way reproduces a sequential one run for run. The threads
running at once never exceed the cores: two 2-thread torch processes on 2 cores wait on each other's
threads and ran 7-10x slower each (benchmarks/results/NOTEBOOK.md).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional


@dataclass(frozen=True)
class Job:
    """One run: ``fn(*args)`` in a worker process at ``threads`` torch threads (0: torch's default, every
    core), on as many cores."""

    key: Hashable
    fn: Callable[..., Any]
    args: tuple = ()
    threads: int = 1
    priority: float = 0.0
    """Among jobs ready at once, higher runs first (warm-starts before the runs that wait on them)."""


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def run_in_worker(threads: int, fn: Callable[..., Any], args: tuple) -> Any:
    """What a worker runs: set torch's thread count, then the job."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    return fn(*args)


def cores_of(job: Job, cores: int) -> int:
    """The cores ``job`` occupies: its threads (0, torch's default: all of them), at most ``cores``."""
    return min(job.threads or cores, cores)


def jobs_to_start(pending: list[Job], busy: int, cores: int) -> list[Job]:
    """The jobs of ``pending`` that start now, ``busy`` of ``cores`` being taken: in priority order
    (highest first, ties in ``pending``'s order) while each fits the free cores. The first that does not
    fit stops the taking: it waits for cores rather than let smaller jobs pass it and starve it."""
    starting = []
    for job in sorted(pending, key=lambda job: -job.priority):
        if cores_of(job, cores) > cores - busy:
            break
        starting.append(job)
        busy += cores_of(job, cores)
    return starting


def run_jobs(
    jobs: Iterable[Job],
    cores: int,
    then: Optional[Callable[[Job, Any], Iterable[Job]]] = None,
) -> dict[Hashable, Any]:
    """Run ``jobs`` in worker processes (spawned: no torch state is forked), never more threads at once
    than ``cores`` (``jobs_to_start``); returns each job's result by key. ``then(job, result)``, called in
    this process as each job finishes, returns the jobs that become possible (an arm's runs once its
    seed's warm-start is trained). Workers are reused from job to job."""
    if cores < 1:
        raise ValueError(f"cores must be at least 1, got {cores}")
    pending = list(jobs)
    results: dict[Hashable, Any] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=cores, mp_context=context) as pool:
        running = {}
        while pending or running:
            # Only what starts now is handed to the pool, so a job made later by ``then`` with a higher
            # priority is not queued behind others.
            for job in jobs_to_start(pending, sum(cores_of(j, cores) for j in running.values()), cores):
                pending.remove(job)
                running[pool.submit(run_in_worker, job.threads, job.fn, job.args)] = job
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                results[job.key] = future.result()
                if then is not None:
                    pending.extend(then(job, results[job.key]))
    return results
