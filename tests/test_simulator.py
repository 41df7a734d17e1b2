"""`recscale simulate`: a simulated step is well-formed and consistent (its breakdown is its
critical path, its trace is valid, overlap and bandwidth only help), and an MLPerf-sized model
on 16 hosts x 8 GPUs simulates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recscale.cli import main
from recscale.sim.api import simulate
from recscale.sim.topology import load_topology, topology_from_dict
from recscale.sim.traffic import all_to_all, ring_all_gather, ring_all_reduce
from recscale.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT.parent / "shared" / "data" / "tables" / "criteo_table_sizes.json"
SMALL = ["model.table_rows=[5000]", "data.pooling_factors=[2]", "model.embedding_dim=16",
         "train.batch_size=512", "model.bottom_mlp=[32, 16]", "model.top_mlp=[32, 1]"]
FEATURES = 26  # synthetic data: Criteo's 26 sparse features


def small(*extra: str):
    return load_config(ROOT / "configs" / "synthetic.toml", [*SMALL, *extra])


def topo(hosts: int, per_host: int, mbit: float, **kw):
    return topology_from_dict({"base": "local-cpu", "hosts": hosts, "ranks_per_host": per_host, "cross_host_mbit": mbit,
                               "flops_per_s": 2e10, "op_overhead_s": 2e-5, "load_s_per_sample": 1e-7, **kw}, "test")


@pytest.mark.parametrize("plan", ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "auto"])
def test_step_is_consistent(plan):
    res = simulate(small(f"sharding.default={plan}"), topo(2, 2, 1000))
    assert res.step_time_s > 0 and res.samples_per_s == pytest.approx(512 / res.step_time_s)
    # the breakdown is the critical path's time by category over the step: it sums to the step
    assert sum(res.breakdown.values()) == pytest.approx(res.step_time_s, rel=1e-9)
    assert all(v >= 0 for v in res.breakdown.values())
    # the path runs forward in time, each op starting no earlier than its cause ended (or
    # than its link was freed by it), and ends where the step ends
    path = res.critical_path
    assert path[-1].end == pytest.approx(res.window[1])
    for a, b in zip(path, path[1:]):
        assert b.start >= a.start and b.end >= a.end
    # in steady state no rank computes longer than a step
    for r in range(4):
        compute = sum(op.duration_s for op in res.ops if op.step == 2 and op.stream == "compute" and r in op.ranks)
        assert compute <= res.step_time_s * (1 + 1e-9)


def test_pipeline_never_slower_and_bandwidth_never_hurts():
    for plan in ("table_wise", "row_wise", "data_parallel"):
        prev = None
        for mbit in (50, 200, 1000, 10_000, 100_000):
            on = simulate(small(f"sharding.default={plan}"), topo(2, 2, mbit)).step_time_s
            off = simulate(small(f"sharding.default={plan}", "train.pipeline=false"), topo(2, 2, mbit)).step_time_s
            assert on <= off * (1 + 1e-9), (plan, mbit, on, off)
            if prev is not None:
                assert on <= prev * (1 + 1e-9), (plan, mbit)
            prev = on
    # a slow link shows: the pipeline hides the ids exchange, and 50 Mbit/s costs more than 100 Gbit/s
    slow = simulate(small("sharding.default=table_wise"), topo(2, 1, 50))
    fast = simulate(small("sharding.default=table_wise"), topo(2, 1, 100_000))
    assert slow.step_time_s > 2 * fast.step_time_s
    assert slow.breakdown.get("output distribution", 0) > 0


def test_step_runs_the_forward_in_program_order():
    """As ``DLRM.forward`` runs it: the bottom MLP computes while the pooled outputs travel, and
    the replicas pool after it (their backward's order: ``test_sim_connections``)."""
    def first(res, name: str, rank: int = 0):
        return next(op for op in res.ops if op.step == 2 and op.name == name and rank in op.ranks)

    sharded = simulate(small("sharding.default=table_wise"), topo(2, 1, 50))
    out, bottom = first(sharded, "output all-to-all"), first(sharded, "bottom MLP forward")
    assert bottom.start < out.end_for(0)  # overlapped, not after the outputs arrived
    assert first(sharded, "unpack outputs").start >= out.end_for(0)
    replicated = simulate(small("sharding.default=data_parallel"), topo(2, 2, 1000))
    look = first(replicated, "replica lookup")
    assert look.duration_s > 0 and look.start >= first(replicated, "bottom MLP forward").end


def test_link_bytes_follow_placement():
    t = topo(2, 2, 1000)
    # every source sends 10 bytes to rank 3 only: host 0's two ranks send 20 bytes over its link,
    # rank 2 sends 10 over shared memory, rank 3 receives 30
    links = all_to_all(t, [0, 0, 0, 10.0])
    assert links[("host_out", 0)] == 20 and links[("host_in", 1)] == 20 and links[("host_out", 1)] == 0
    assert links[("intra_out", 2)] == 10 and links[("intra_in", 3)] == 10
    ring = ring_all_reduce(t, 100.0)
    assert ring[("host_out", 0)] == pytest.approx(2 * 3 / 4 * 100)
    tiered = topology_from_dict({"base": "zionex", "hosts": 4, "ranks_per_host": 2,
                                 "tiers": [{"hosts_per_group": 2, "bandwidth_gbit": 10}]}, "test")
    links = all_to_all(tiered, [1.0] * 8)
    assert links[("tier0_out", 0)] == 4 * 4  # 4 ranks of building 0 send to 4 ranks elsewhere


def test_gathers_go_around_the_ring():
    """An all-gather (gloo's and NCCL's) passes every part along the ring: each edge, a tier's
    uplink included, carries W-1 parts; the replicas' gradient exchange is priced that way."""
    from recscale.comm.process_group import Topology
    from recscale.embedding import TableConfig
    from recscale.planner.cost_model import Workload
    from recscale.sharding.default_plan import TableSharding, default_plan
    from recscale.sim.step import StepInputs, replica_links
    from recscale.train.planning import table_specs

    tiered = topology_from_dict({"base": "zionex", "hosts": 4, "ranks_per_host": 2,
                                 "tiers": [{"hosts_per_group": 2, "bandwidth_gbit": 10}]}, "test")
    ring = ring_all_gather(tiered, 1.0)
    assert ring[("tier0_out", 0)] == ring[("tier0_in", 1)] == 7  # not 4 x 4 as straight sends
    assert ring[("host_out", 0)] == ring[("intra_out", 0)] == 7 and ("intra_out", 1) not in ring
    assert ring_all_reduce(tiered, 8.0) == ring_all_gather(tiered, 2.0)  # reduce-scatter + all-gather of 8 parts
    cfg = small("model.table_rows=[5000, 300]", "data.pooling_factors=[2, 1]")
    specs = table_specs(cfg)
    tables = [TableConfig(t.name, t.rows, t.dim, (t.name[2:],)) for t in specs]
    replicated = {t.name: TableSharding("data_parallel") for t in specs}
    plan = default_plan(tables, Topology(8, 0, 2), "table_wise", replicated)
    links = replica_links(StepInputs(specs, Workload(cfg.train.batch_size), plan, None, True), tiered)
    # gathered around the ring: the uplink carries what a host link does (straight: 16/12 of it)
    assert links[("tier0_out", 0)] == pytest.approx(links[("host_out", 0)]) and links[("host_out", 0)] > 0


def test_cli_writes_json_and_trace(tmp_path, capsys):
    spec = tmp_path / "two_hosts.toml"
    spec.write_text('base = "local-cpu"\nhosts = 2\nranks_per_host = 1\ncross_host_mbit = 200\nflops_per_s = 2e10\n')
    out, trace = tmp_path / "sim.json", tmp_path / "trace.json"
    sets = [a for s in [*SMALL, "sharding.default=table_wise"] for a in ("--set", s)]
    rc = main(["simulate", "--config", str(ROOT / "configs" / "synthetic.toml"), *sets, "--topology", str(spec),
               "--json", str(out), "--trace", str(trace)])
    assert rc == 0
    assert "samples/s" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["step_time_s"] > 0 and d["samples_per_s"] == pytest.approx(512 / d["step_time_s"])
    assert sum(d["breakdown"].values()) == pytest.approx(d["step_time_s"])
    assert d["topology"]["world_size"] == 2 and len(d["memory_bytes_per_rank"]["per_rank"]) == 2
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and {e["pid"] for e in spans} == {0, 1}
    assert all(e["dur"] >= 0 and 0 <= e["ts"] <= d["step_time_s"] * 1e6 + 1e-6 for e in spans)
    assert any(e["name"] == "output all-to-all" for e in spans)


def test_bad_topology_is_one_line_error(tmp_path, capsys):
    spec = tmp_path / "t.toml"
    spec.write_text('hosts = 2\ncross_host_mbps = 200\n')
    assert main(["simulate", "--topology", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "cross_host_mbps" in err and "unknown key" in err and "Traceback" not in err
    assert main(["simulate", "--topology", "nonesuch"]) == 2


@pytest.mark.skipif(not TABLES.is_file(), reason="no MLPerf table shapes under ../shared/data/tables")
def test_mlperf_dcnv2_on_16_hosts_of_8_gpus(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from simulator_dcnv2 import config_text

    cfg_path = tmp_path / "dcnv2.toml"
    cfg_path.write_text(config_text(TABLES, "mlperf_dlrm_dcnv2"))
    t = time.perf_counter()
    res = simulate(load_config(cfg_path, []), load_topology("zionex", 16, 8))
    seconds = time.perf_counter() - t
    print(f"DLRM-DCNv2 shapes on 16 x 8 zionex: {res.samples_per_s:,.0f} samples/s, simulated in {seconds:.1f} s")
    assert len(res.busy_s) == 128 and res.samples_per_s > 0
    assert sum(res.breakdown.values()) == pytest.approx(res.step_time_s)
    # every table fits: no rank holds more than its 40 GB
    assert max(sum(m.values()) for m in res.memory_bytes) < 40e9


def test_validation_scoring():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    assert sv.kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0 and sv.kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0
    # predictions equal but for rounding are a tie (0), not an order; a real difference counts
    tie = 12980.549256522901
    assert sv.kendall_tau([2, 1, 3], [tie, tie + 4e-12, 30000]) == pytest.approx(2 / 3)
    assert sv.kendall_tau([2, 1, 3], [tie, tie - 1e-3, 30000]) == 1.0
    g = sv.Group("g", 1, 2, None, ("a", "b", "c"))
    cases = {("g", "a"): sv.Case("g", "a", [100.0], 110.0), ("g", "b"): sv.Case("g", "b", [200.0], 180.0),
             ("g", "c"): sv.Case("g", "c", [196.0], 190.0)}
    res = sv.score([g], cases)
    assert res["configs"] == 3 and res["geomean_error"] == pytest.approx((0.1 * 0.1 * (6 / 196)) ** (1 / 3))
    # predicted order c > b > a, measured b > c > a: one discordant pair of three; c is within 5% of b
    (grp,) = res["groups"]
    assert grp["tau"] == pytest.approx(1 / 3) and grp["sim_best"] == "c" and grp["best_within_5pct"]


def test_validation_scores_the_order_only_where_the_turns_settle_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    assert sv.sign_test_p(5, 5) == pytest.approx(2 / 32) and sv.sign_test_p(1, 5) == pytest.approx(12 / 32)
    assert sv.sign_test_p(9, 10) == pytest.approx(22 / 1024)
    # a ahead of b in every turn, c and b a toss-up (their medians 150 and 149), d behind all
    members = [sv.Case("g", "a", [300, 310, 290, 305, 295]), sv.Case("g", "b", [150, 140, 160, 149, 155]),
               sv.Case("g", "c", [140, 150, 155, 160, 149]), sv.Case("g", "d", [100, 101, 99, 100, 98])]
    assert sorted(sv.resolved_pairs(members)) == [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]
    # the simulator's b > c (a toss-up) cannot count against it; its b > a does
    tau, known, wrong = sv.resolved_tau(members, [145.0, 150.0, 140.0, 100.0])
    assert known == 5 and tau == pytest.approx(3 / 5) and wrong == ["a > b"]
    g = sv.Group("g", 1, 2, None, ("a", "b", "c", "d"))
    (grp,) = sv.score([g], {("g", c.plan): c for c in members})["groups"]
    assert grp["pairs"] == 6 and grp["resolved_pairs"] == 5


def test_validation_runs_a_failed_run_once_more(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    g = sv.Group("g", 1, 2, None, ("a",))
    outcomes = [sv.RunFailed("run failed (g, a), exit status -6"), (123.0, None)]

    def once(*_):
        o = outcomes.pop(0)
        if isinstance(o, Exception):
            raise o
        return o

    monkeypatch.setattr(sv, "_measure_once", once)
    monkeypatch.setattr(sv, "_FAILED", [])
    assert sv.measure(g, "a", 20, 1024) == (123.0, None)
    assert sv._FAILED == ["run failed (g, a), exit status -6"]
    # a second failure in a row stops the validation with its message
    outcomes[:] = [sv.RunFailed("first"), sv.RunFailed("second")]
    with pytest.raises(SystemExit, match="second"):
        sv.measure(g, "a", 20, 1024)


def test_validation_pipeline_pairs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    # every ", no pipeline" group has its pipelined twin, with the same link and data
    gs = {g.name: g for g in sv.groups(quick=False)}
    offs = [g for name, g in gs.items() if name.endswith(", no pipeline")]
    assert len(offs) == 2
    for off in offs:
        on = gs[off.name.removesuffix(", no pipeline")]
        assert (on.hosts, on.ranks_per_host, on.mbit) == (off.hosts, off.ranks_per_host, off.mbit)
        assert set(off.sets) - set(on.sets) == {"train.pipeline=false"} and set(on.plans) >= set(off.plans)
    # --only "pooling x20" selects just that pair
    pair = [g.name for g in gs.values() if "pooling x20" in g.name]
    assert pair == [sv.PIPELINE_PAIR, f"{sv.PIPELINE_PAIR}, no pipeline"]
    on, off = sv.pipeline_pair()
    cases = {(on.name, "table_wise"): sv.Case(on.name, "table_wise", [120.0, 110.0, 130.0], 115.0),
             (off.name, "table_wise"): sv.Case(off.name, "table_wise", [100.0, 100.0, 100.0], 100.0)}
    (pair,) = sv.score([on, off], cases)["pipeline"]
    assert pair["group"] == on.name and pair["turn_ratios"] == [1.2, 1.1, 1.3]
    assert pair["measured_ratio"] == pytest.approx(1.2) and pair["predicted_ratio"] == pytest.approx(1.15)
    sv.report(sv.score([on, off], cases))  # prints the ratio's spread without failing


def test_validation_prices_a_pipeline_pair_from_one_loader_measurement(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    calls = []
    monkeypatch.setattr(sv, "measure_loader", lambda cfg, world_size: calls.append(world_size) or 1e-5)
    monkeypatch.setattr(sv, "_LOADER", {})
    monkeypatch.setattr(sv, "link_latency", lambda g: 0.0)  # the link's probe is not under test
    on, off = sv.pipeline_pair()
    topos = [sv.topology(g, sv.load_config(sv.CONFIG, sv.overrides(g, "table_wise", 4, 64))) for g in (on, off)]
    assert calls == [2] and topos[0].compute.load_s_per_sample == topos[1].compute.load_s_per_sample
    plain = sv.Group("g", 2, 1, 500, ("table_wise",))  # other data: measured on its own
    sv.topology(plain, sv.load_config(sv.CONFIG, sv.overrides(plain, "table_wise", 4, 64)))
    assert calls == [2, 2]


def test_validation_prices_the_loader_at_the_median_of_its_turns(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    draws = iter([3e-5, 1e-5, 2e-5, 7e-5, 5e-5, 6e-5])
    calls = []
    monkeypatch.setattr(sv, "measure_loader", lambda cfg, world_size: calls.append(world_size) or next(draws))
    monkeypatch.setattr(sv, "_LOADER", {})
    monkeypatch.setattr(sv, "link_latency", lambda g: 0.0)
    on, off = sv.pipeline_pair()
    plain = sv.Group("g", 2, 1, 500, ("table_wise",))  # other data: measurements of its own
    for _ in range(3):  # one per turn and data set: the pair shares its data
        sv.sample_loaders([on, off], lambda g: 4, 64)
    sv.sample_loaders([plain], lambda g: 4, 64)
    assert calls == [2, 2, 2, 2]
    cfgs = [sv.load_config(sv.CONFIG, sv.overrides(g, "table_wise", 4, 64)) for g in (on, off, plain)]
    assert [sv.loader_cost(g, c) for g, c in zip((on, off, plain), cfgs)] == [2e-5, 2e-5, 7e-5]
    assert sv.topology(off, cfgs[1]).compute.load_s_per_sample == 2e-5
    # a recording's measurements price a refit alike, without measuring again
    saved = json.loads(json.dumps(sv._LOADER))
    monkeypatch.setattr(sv, "_LOADER", saved)
    assert sv.loader_cost(on, cfgs[0]) == 2e-5 and len(calls) == 4


def test_this_machine_needs_a_calibration(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["simulate", "--topology", "this-machine", "--ranks-per-host", "1"]) == 2
    assert "recscale calibrate --ranks 1" in capsys.readouterr().err
    from recscale.planner.hardware import LOCAL_CPU, cached_calibration

    path = cached_calibration(1)
    path.parent.mkdir(parents=True)
    LOCAL_CPU.with_world(1, 1).save(path)
    assert load_topology("this-machine", 1, 1).world_size == 1


def test_shared_cores_stretch_compute_and_take_the_loader():
    cfg = small("sharding.default=table_wise")
    own = simulate(cfg, topo(2, 2, 10_000))
    shared = simulate(cfg, topo(2, 2, 10_000, shared_cores=2))
    assert shared.step_time_s > 1.5 * own.step_time_s
    loads = [op for op in shared.ops if op.name == "load batch"]
    assert loads and all(op.stream == "compute" for op in loads)
    assert all(op.stream == "load" for op in own.ops if op.name == "load batch")


def test_exchanged_bytes_match_training(tmp_path):
    """The bytes the simulator puts on the links for ids (with their bags' lengths), outputs,
    gradients and column-wise row statistics are what two real ranks send each other."""
    from recscale.comm.local_processes import free_port
    from recscale.sim.api import training_plan
    from recscale.sim.step import StepInputs, _volumes
    from recscale.train.planning import table_specs, workload

    sets = ["model.table_rows=[5000, 300]", "data.pooling_factors=[2, 1]", "sharding.default=column_wise"]
    summary = tmp_path / "s.json"
    run = ["train.max_steps=6", "data.num_samples=4096", "data.eval_samples=512", "train.progress=false",
           "train.threads=1", "data.num_workers=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "recscale", "train", "--config", str(ROOT / "configs" / "synthetic.toml"),
           "--summary-json", str(summary)] + [a for s in [*SMALL, *sets, *run] for a in ("--set", s)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    sent = json.loads(summary.read_text())["comm_bytes_per_step"]  # by rank 0, to rank 1
    cfg = small(*sets)
    t = topo(2, 1, 1000)
    specs = table_specs(cfg)
    ids, out, grad, _, cw = _volumes(StepInputs(specs, workload(cfg), training_plan(cfg, t, specs), None, True), t)
    assert out[1] == pytest.approx(sent["output_a2a"]) and grad[1] == pytest.approx(sent["grad_a2a"])
    assert ids[1] == pytest.approx(sent["input_ids"] + sent["input_lengths"], rel=0.2)
    assert cw[0] == pytest.approx(sent["cw_row_sq"], rel=0.2)


def test_validation_prices_each_group_on_the_calibration_for_its_ranks_per_host(tmp_path, monkeypatch):
    # a lone rank was priced on the 2-rank calibration, or on another machine's preset when that
    # was missing: the group's own ranks per host, as training's planner finds it, instead
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import simulator_validation as sv

    def cached(ranks, quick=False):
        return tmp_path / f"local-{ranks}{'-quick' if quick else ''}.json"

    import recscale.planner.hardware as hardware

    monkeypatch.setattr(hardware, "cached_calibration", cached)  # where the planner looks
    monkeypatch.setattr(sv, "_CALIBRATIONS", {})
    (tmp_path / "local-1-quick.json").write_text("{}")
    (tmp_path / "local-2.json").write_text("{}")
    (tmp_path / "local-2-quick.json").write_text("{}")
    assert sv.calibration(1) == str(cached(1, quick=True))
    assert sv.calibration(2) == str(cached(2))  # the full one before the quick one
