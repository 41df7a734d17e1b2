"""The synchronisation wait: ranks that meet at collectives take the expected maximum of their
unsteady compute times, priced from a jitter this machine's cores are measured for."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from recscale.planner.jitter import expected_max_normal, measure_jitter, sync_wait_factor, synced_stretch, wait_excess
from recscale.sim.api import simulate
from recscale.sim.topology import TopologyError, load_topology, topology_from_dict
from recscale.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.table_rows=[5000, 300]", "data.pooling_factors=[2, 1]", "model.embedding_dim=16",
         "train.batch_size=1024", "sharding.default=table_wise", "data.num_workers=0"]


def topo(per_host: int, jitter: float):
    return topology_from_dict({"base": "local-cpu", "ranks_per_host": per_host, "flops_per_s": 2e10,
                               "op_overhead_s": 2e-5, "loop_s": 0.0, "sync_jitter": jitter}, "test")


def test_expected_maximum_of_standard_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-4)
    draws = random.Random(0)
    sampled = sum(max(draws.gauss(0, 1) for _ in range(8)) for _ in range(20000)) / 20000
    assert expected_max_normal(8) == pytest.approx(sampled, abs=0.03)
    assert sync_wait_factor(0.3, 1) == 1.0 and sync_wait_factor(0.0, 16) == 1.0
    assert sync_wait_factor(0.2, 2) < sync_wait_factor(0.2, 16)


def test_an_unbalanced_plans_slowest_rank_waits_for_the_others_only_as_much_as_they_can_be_late():
    # Balanced ranks: the expected maximum of as many draws. One rank far slower than the
    # rest: barely stretched. In between, E[max] of independent normals (sampled here).
    assert synced_stretch([4.0, 4.0, 4.0], 0.3) == sync_wait_factor(0.3, 3)
    assert synced_stretch([4.0, 4.0 + 1e-6], 0.3) == pytest.approx(sync_wait_factor(0.3, 2), rel=1e-4)
    assert synced_stretch([8.0, 0.0], 0.3) == 1.0 and synced_stretch([8.0, 2.0], 0.0) == 1.0
    assert synced_stretch([8.0, 0.5], 0.3) == pytest.approx(1.0, abs=1e-3)
    draws = random.Random(1)
    means = [8.5, 13.9, 12.0]
    sampled = sum(max(m * (1 + 0.5 * draws.gauss(0, 1)) for m in means) for _ in range(40000)) / 40000
    assert synced_stretch(means, 0.5) * max(means) == pytest.approx(sampled, rel=0.01)
    assert 1.0 < synced_stretch(means, 0.5) < sync_wait_factor(0.5, 3)


def test_a_rank_with_every_table_is_stretched_less_than_balanced_ranks():
    from recscale.comm.process_group import Topology
    from recscale.embedding import TableConfig
    from recscale.sharding.default_plan import single_rank_plan
    from recscale.sim.api import training_plan

    cfg = load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, "sharding.default=row_wise"])
    balanced = training_plan(cfg, topo(2, 0.0))  # every table split over both ranks alike
    tables = [TableConfig(t.table, sum(x.num_rows for x in t.shards), t.shards[0].num_cols) for t in balanced.tables]
    # every table on rank 0: the other rank has no lookups to be late with
    lopsided = single_rank_plan(tables, Topology(2, 0, 2))
    lookup = {}
    for jitter in (0.0, 0.3):
        for name, plan in (("balanced", balanced), ("lopsided", lopsided)):
            ops = simulate(cfg, topo(2, jitter), plan).ops
            lookup[name, jitter] = max(o.duration_s for o in ops if o.name == "embedding lookup")
    assert lookup["balanced", 0.3] / lookup["balanced", 0.0] == pytest.approx(sync_wait_factor(0.3, 2), rel=1e-6)
    assert lookup["lopsided", 0.3] == pytest.approx(lookup["lopsided", 0.0])


def test_wait_excess_of_aligned_chunks():
    # two cores' chunks, in step: one core is slow exactly when the other is fast
    a = [(k * 1.0, 0.5 if k % 2 else 1.0) for k in range(100)]
    b = [(k * 1.0, 1.0 if k % 2 else 0.5) for k in range(100)]
    assert wait_excess([a, b]) == pytest.approx(1.0 / 0.75 - 1.0)
    # cores that move together never wait for each other
    assert wait_excess([a, list(a)]) == pytest.approx(0.0)
    with pytest.raises(RuntimeError, match="never overlapped"):
        wait_excess([a, [(1000.0, 1.0)]])


def test_jitter_stretches_every_distributed_step_and_no_lone_rank():
    cfg = load_config(ROOT / "configs" / "synthetic.toml", SMALL)
    steady, shaky = simulate(cfg, topo(2, 0.0)), simulate(cfg, topo(2, 0.3))
    assert shaky.step_time_s > steady.step_time_s * 1.05
    # the compute stretches by the factor; the bytes' time does not
    assert shaky.step_time_s < steady.step_time_s * sync_wait_factor(0.3, 2) + 1e-9
    one = load_config(ROOT / "configs" / "synthetic.toml", SMALL)
    assert simulate(one, topo(1, 0.3)).step_time_s == pytest.approx(simulate(one, topo(1, 0.0)).step_time_s)


def test_a_negative_jitter_is_refused():
    with pytest.raises(TopologyError, match="sync_jitter"):
        topo(2, -0.1)


def test_measured_jitter_is_a_small_nonnegative_number():
    j = measure_jitter(2, chunk_s=0.002, seconds=0.6, windows=1)
    assert 0.0 <= j < 5.0
    assert measure_jitter(1) == 0.0


def test_a_calibration_prices_the_wait_at_its_own_jitter(tmp_path):
    # Its collective figures are fitted net of the wait at the jitter it measured: the
    # simulator must add back that wait, not another measurement's; a topology key still wins.
    from dataclasses import replace

    from recscale.planner.hardware import PRESETS

    path = tmp_path / "calibration.json"
    replace(PRESETS["local-cpu"], world_size=2, ranks_per_host=2, sync_jitter=0.37).save(path)
    assert topology_from_dict({"base": str(path)}, "test").compute.sync_jitter == 0.37
    assert topology_from_dict({"base": str(path), "sync_jitter": 0.1}, "test").compute.sync_jitter == 0.1
    assert topology_from_dict({"base": "local-cpu"}, "test").compute.sync_jitter != 0.37
    assert load_topology(str(path)).compute.sync_jitter == 0.37  # the file itself as --topology
    with pytest.raises(ValueError, match="sync_jitter"):
        replace(PRESETS["local-cpu"], sync_jitter=-0.1)
