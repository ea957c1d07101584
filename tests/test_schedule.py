"""experiments/schedule.py: jobs over worker processes, follow-ups made from results, the thread count
set per job, priorities among ready jobs, never more threads at once than cores."""

import operator

import pytest
import torch

from experiments.schedule import Job, jobs_to_start, run_jobs


def test_a_follow_up_job_is_made_from_its_parents_result():
    def then(job, result):
        return [Job("times ten", operator.mul, (result, 10))] if job.key == "sum" else []

    assert run_jobs([Job("sum", operator.add, (1, 2))], cores=2, then=then) == {"sum": 3, "times ten": 30}


def test_each_job_runs_at_its_own_thread_count():
    jobs = [Job("one", torch.get_num_threads, threads=1), Job("two", torch.get_num_threads, threads=2)]
    assert run_jobs(jobs, cores=2) == {"one": 1, "two": 2}


def test_ready_jobs_run_highest_priority_first():
    finished = []

    def then(job, result):
        finished.append(job.key)
        # Made after "high", "made later" outranks "low", which was ready before it.
        return [Job("made later", operator.neg, (1,), priority=2)] if job.key == "high" else []

    jobs = [Job("low", operator.neg, (1,)), Job("high", operator.neg, (2,), priority=1)]
    run_jobs(jobs, cores=1, then=then)
    assert finished == ["high", "made later", "low"]


def test_a_job_waits_for_as_many_free_cores_as_it_runs_threads():
    first, wide, last = Job("first", abs, threads=1, priority=2), Job("wide", abs, threads=2, priority=1), Job("last", abs)
    assert jobs_to_start([last, wide, first], busy=0, cores=2) == [first]  # wide needs both cores
    assert jobs_to_start([last, wide], busy=1, cores=2) == []  # last does not pass the waiting wide job
    assert jobs_to_start([last, wide], busy=0, cores=2) == [wide]
    assert jobs_to_start([last], busy=0, cores=2) == [last]
    # threads 0 (torch's default) takes every core; more threads than cores take them all.
    assert jobs_to_start([Job("default", abs, threads=0), last], busy=0, cores=4) == [Job("default", abs, threads=0)]
    assert jobs_to_start([Job("eight", abs, threads=8)], busy=0, cores=4) == [Job("eight", abs, threads=8)]


def test_no_cores_is_refused():
    with pytest.raises(ValueError, match="cores must be at least 1, got 0"):
        run_jobs([Job("sum", operator.add, (1, 2))], cores=0)
