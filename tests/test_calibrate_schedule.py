"""How a calibration spends its minutes: one build of a probe's collection for all its batch
sizes, and one start of the local processes for a whole round of probes, with the same
timings as probe by probe."""

from __future__ import annotations

import pytest

from recscale.comm.process_group import Topology
from recscale.embedding import TableConfig
from recscale.host_cpus import CpuBudget
from recscale.planner import calibrate
from recscale.planner.cost_model import TableSpec
from recscale.planner.measure import synthetic_batches, time_contention, time_plans
from recscale.sharding.default_plan import default_plan

TABLES = [TableSpec("a", 300, 8, 2), TableSpec("b", 50, 4, 1)]


def _plan(world: int, kind: str):
    return default_plan([TableConfig(t.name, t.rows, t.dim) for t in TABLES], Topology(world, 0, world), kind)


def test_probes_of_one_plan_are_grouped_by_batch_size_and_none_is_lost():
    cases = calibrate.compute_cases((512, 2048), quick=True)
    jobs = calibrate._by_plan(cases)
    assert sorted(c[0] for job in jobs for c in job) == sorted(c[0] for c in cases)
    for job in jobs:
        assert len({c[0].rsplit("/B", 1)[0] for c in job}) == 1
        assert [c[0].rsplit("/B", 1)[1] for c in job] == ["512", "2048"]
        assert {(tuple(t.rows for t in c[2]), tuple(t.dim for t in c[2])) for c in job} == {
            (tuple(t.rows for t in job[0][2]), tuple(t.dim for t in job[0][2]))}


@pytest.mark.parametrize("world", [1, 2])
def test_time_plans_gives_a_time_per_job_and_batch_set(world):
    small, big = synthetic_batches(TABLES, 64, 2, seed=1), synthetic_batches(TABLES, 256, 2, seed=2)
    jobs = [(_plan(world, "table_wise"), TABLES, [small, big]), (_plan(world, "row_wise"), TABLES, [small])]
    got = time_plans(jobs, steps=2)
    assert [len(t) for t in got] == [2, 1]
    assert all(t > 0 for ts in got for t in ts)
    with pytest.raises(ValueError, match="same number of ranks"):
        time_plans([jobs[0], (_plan(3 - world, "table_wise"), TABLES, [small])])


def test_contention_times_every_job_alone_and_side_by_side_in_every_round_on_one_start():
    gb = synthetic_batches(TABLES, 64, 2, seed=1)
    alone, together = time_contention([(_plan(1, "table_wise"), TABLES, gb), (_plan(1, "data_parallel"), TABLES, gb)],
                                      2, steps=2, rounds=2)
    assert [len(a) for a in alone] == [2, 2] and [len(t) for t in together] == [2, 2]
    assert all(x > 0 for xs in alone + together for x in xs)


def test_a_calibration_round_times_each_plan_once_for_all_batch_sizes(monkeypatch):
    seen = []

    def fake(jobs, steps, threads=None, shared_memory=True):
        seen.append(len(jobs))
        return [[1e-3] * len(j[2]) for j in jobs]

    monkeypatch.setattr(calibrate, "time_plans", fake)
    times = calibrate.measure_compute(1, (512, 2048), 1, quick=True, rounds=2)
    cases = calibrate.compute_cases((512, 2048), quick=True)
    assert seen == [len(cases) // 2] * 2
    assert {len(v) for v in times.values()} == {2} and set(times) == {c[0] for c in cases}


def test_calibrate_times_under_trainings_openmp_policy():
    # training lets idle OpenMP threads sleep; a calibration timed with spinning threads on a busy
    # machine prices the embeddings several times dearer than training pays
    import os
    import subprocess
    import sys

    code = ("import os, sys; from recscale.cli import _prefer_passive_openmp_for_train as f; f(sys.argv[1:]); "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = [subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True).stdout.strip()
           for args in (["calibrate", "--ranks", "2"], ["plan"])]
    assert out == ["PASSIVE", "None"]


@pytest.mark.parametrize("copies,cores,expected", [(2, 2, 0.25), (4, 2, 0.25), (4, 1, 0.25), (2, 4, 0.25)])
def test_contention_counts_copies_beyond_the_cores_per_core(monkeypatch, copies, cores, expected):
    # four copies on two cores take turns: twice the time is their share of the cores (which the
    # simulator charges), only what is left is the memory system's contention
    turns = max(1.0, copies / cores)
    monkeypatch.setattr(calibrate, "usable_cpus", lambda read_cgroup: CpuBudget(cores, "test"))
    monkeypatch.setattr(calibrate, "time_contention",
                        lambda jobs, n, steps, rounds: ([[1e-3, 2e-3]] * len(jobs), [[1.25e-3 * turns, 3e-3 * turns]] * len(jobs)))
    assert calibrate.measure_contention(copies, 64, 1, rounds=2) == pytest.approx(expected)
