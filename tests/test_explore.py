"""`recscale explore`: tiers files become the simulator's topology, the search returns a ranked,
well-formed result whose best is no worse than any baseline under the simulator, a spent time
budget still returns the baselines, and bad tiers input is a one-line error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from recscale.cli import main
from recscale.sim.explore import explore
from recscale.sim.tiers import cluster_from_dict, load_cluster
from recscale.sim.topology import TopologyError
from recscale.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.table_rows=[5000, 300, 40000]", "data.pooling_factors=[2]", "model.embedding_dim=16",
         "train.batch_size=512", "model.bottom_mlp=[32, 16]", "model.top_mlp=[32, 1]"]
TIERS = {"name": "small", "base": "local-cpu", "ranks_per_host": 2, "hosts_per_pod": 2, "pods_per_building": 1,
         "buildings": 2, "links": {"host": {"bandwidth_gbit": 1}, "building": {"oversubscription": 4, "latency_ms": 1.0}}}


def test_tiers_become_topology():
    two = load_cluster("two-buildings").topology()
    assert (two.hosts, two.ranks_per_host, two.world_size) == (16, 8, 128)
    (tier,) = two.tiers  # one building uplink: 8 hosts' links, 1:4 oversubscribed, 1 ms more
    assert tier.hosts_per_group == 8 and tier.latency_s == pytest.approx(1e-3)
    assert tier.bandwidth == pytest.approx(8 * two.host_link_bw / 4)
    z = load_cluster("zionex").topology()
    assert z.world_size == 128 and z.tiers == ()
    small = cluster_from_dict(TIERS, "t")
    assert small.shrink(1, 1).topology().world_size == 2 and small.shrink(1, 1).topology().tiers == ()


def test_explore_small_is_ranked_and_beats_baselines(tmp_path):
    cfg = load_config(ROOT / "configs" / "synthetic.toml", SMALL)
    e = explore(cfg, cluster_from_dict(TIERS, "t"), time_budget_s=60, top_k=4)
    speeds = [s.result.samples_per_s for s in e.scored]
    assert speeds == sorted(speeds, reverse=True) and e.analytic_count >= len(e.scored) > 2
    for name in ("production-default", "recscale-planner"):
        assert speeds[0] >= e.baselines[name].result.samples_per_s
    assert isinstance(e.baselines["torchrec-planner"], str)
    # on a slow, oversubscribed building link the search finds more than the flat default
    assert speeds[0] > 1.3 * e.baselines["production-default"].result.samples_per_s
    out, html = tmp_path / "x.json", tmp_path / "x.html"
    tiers = tmp_path / "t.json"
    tiers.write_text(json.dumps(TIERS))
    args = ["explore", "--config", str(ROOT / "configs" / "synthetic.toml"), "--topology", str(tiers), "--time-budget", "60",
            "--top", "3", "--out", str(out), "--report", str(html)] + [a for s in SMALL for a in ("--set", s)]
    assert main(args) == 0
    d = json.loads(out.read_text())
    c = d["candidates"]
    assert [x["predicted_samples_per_s"] for x in c] == sorted((x["predicted_samples_per_s"] for x in c), reverse=True)
    for x in c + list(v for v in d["baselines"].values() if "unavailable" not in v):
        assert x["plan"]["world_size"] == x["launch"]["world_size"] and x["overrides"] and x["breakdown"]
        assert sum(x["breakdown"].values()) == pytest.approx(x["step_time_s"])
    assert set(d["baselines"]) == {"production-default", "recscale-planner", "torchrec-planner"}
    assert "<table>" in html.read_text()


def test_spent_budget_still_returns_baselines():
    cfg = load_config(ROOT / "configs" / "synthetic.toml", SMALL)
    e = explore(cfg, cluster_from_dict(TIERS, "t"), time_budget_s=1e-6, top_k=4)
    assert e.notes and len(e.scored) >= 1
    assert e.scored[0].result.samples_per_s >= e.baselines["production-default"].result.samples_per_s


@pytest.mark.parametrize("bad, word", [({"buildings": 0}, "buildings"), ({"racks": 2}, "racks"),
                                       ({"links": {"building": {"oversubscription": -1}}}, "oversubscription"),
                                       ({"base": "nonesuch"}, "base"), ({"shared_cores": -1}, "shared_cores")])
def test_bad_tiers_is_one_line_error(tmp_path, capsys, bad, word):
    spec = tmp_path / "t.json"
    spec.write_text(json.dumps({**TIERS, **bad}))
    with pytest.raises(TopologyError):
        load_cluster(str(spec))
    assert main(["explore", "--config", str(ROOT / "configs" / "synthetic.toml"), "--topology", str(spec)]) == 2
    err = capsys.readouterr().err
    assert word in err and "Traceback" not in err and err.count("\n") == 1


def test_emulated_two_groups_candidates_are_runnable(tmp_path):
    """The emulated cluster as tiers: two buildings of hosts sharing this machine's cores; each
    candidate comes with its plan file and the `recscale cluster` command that trains it."""
    from recscale.cluster.command import add_parser as cluster_parser
    from recscale.sharding.plan import ShardingPlan
    from recscale.sim.tiers import emulated_cluster

    cluster = emulated_cluster(2, 1, 100, 50, 2, compute={"load_s_per_sample": 2e-6})
    topo = cluster.topology()
    (tier,) = topo.tiers
    assert (topo.hosts, topo.world_size, topo.shared_cores) == (4, 4, 2)
    assert tier.hosts_per_group == 2 and tier.bandwidth == pytest.approx(50e6 / 8)
    assert topo.host_link_bw == pytest.approx(100e6 / 8) and topo.compute.load_s_per_sample == 2e-6
    assert cluster.cluster_args() == ["--hosts", "4", "--ranks-per-host", "1", "--bandwidth-mbit", "100",
                                      "--groups", "2", "--cross-bandwidth-mbit", "50"]
    assert cluster.shrink(1, 1).cluster_args() == ["--hosts", "2", "--ranks-per-host", "1", "--bandwidth-mbit", "100"]
    assert load_cluster("two-buildings").cluster_args() is None  # added latency: no netem to emulate it with
    spec = tmp_path / "emulated.json"
    spec.write_text(json.dumps(cluster.to_dict()))
    assert cluster_from_dict(json.loads(spec.read_text()), "e") == cluster
    out, plans = tmp_path / "x.json", tmp_path / "plans"
    config = str(ROOT / "configs" / "synthetic.toml")
    assert main(["explore", "--config", config, "--topology", str(spec), "--time-budget", "30", "--top", "2",
                 "--out", str(out), "--plans-dir", str(plans)] + [a for s in SMALL for a in ("--set", s)]) == 0
    d = json.loads(out.read_text())
    parser = argparse.ArgumentParser()
    cluster_parser(parser.add_subparsers())
    for x in d["candidates"][:3] + [d["baselines"]["production-default"]]:
        cmd = x["cluster_command"]
        assert cmd[:2] == ["recscale", "cluster"]
        args = parser.parse_args(cmd[1:])
        assert args.hosts * args.ranks_per_host == x["launch"]["world_size"]
        assert (args.groups == 2) == (x["launch"]["buildings"] == 2)
        train = args.job[1:]
        assert train == x["train_args"] and train[:3] == ["train", "--config", config]
        sets = [train[i + 1] for i, a in enumerate(train) if a == "--set"]
        cfg = load_config(config, sets)  # the overrides and the plan file are valid training input
        assert cfg.sharding.plan == x["plan_file"] and cfg.train.batch_size == 512
        plan = ShardingPlan.load(x["plan_file"])
        assert plan.to_dict() == x["plan"] and plan.world_size == x["launch"]["world_size"]


def test_use_all_ranks_fixes_the_world_size(tmp_path):
    """With use_all_ranks every candidate runs on every rank; the search reports its budget."""
    cfg = load_config(ROOT / "configs" / "synthetic.toml", SMALL)
    cluster = cluster_from_dict(TIERS, "t")
    free = explore(cfg, cluster, time_budget_s=60, top_k=4)
    assert {s.candidate.placement for s in free.scored} > {s.candidate.placement for s in free.scored
                                                          if s.candidate.placement.buildings == 2
                                                          and s.candidate.placement.ranks_per_host == 2}
    fixed = explore(cfg, cluster, time_budget_s=60, top_k=4, use_all_ranks=True)
    assert {(s.candidate.placement.buildings, s.candidate.placement.ranks_per_host) for s in fixed.scored} == {(2, 2)}
    assert fixed.analytic_count < free.analytic_count and fixed.time_budget_s == 60
    assert fixed.within_budget == (fixed.seconds <= 60)
    # the fixed search is the free one's candidates on every rank: its best is the free one's best there
    best_full = max(s.result.samples_per_s for s in free.scored if s.candidate.placement.buildings == 2
                    and s.candidate.placement.ranks_per_host == 2)
    assert fixed.scored[0].result.samples_per_s >= best_full * (1 - 1e-9)
    tiers = tmp_path / "t.json"
    tiers.write_text(json.dumps(TIERS))
    out = tmp_path / "x.json"
    assert main(["explore", "--config", str(ROOT / "configs" / "synthetic.toml"), "--topology", str(tiers),
                 "--time-budget", "60", "--top", "2", "--use-all-ranks", "--out", str(out)]
                + [a for s in SMALL for a in ("--set", s)]) == 0
    d = json.loads(out.read_text())
    assert {x["launch"]["world_size"] for x in d["candidates"]} == {8}
    assert isinstance(d["search"]["within_budget"], bool) and d["search"]["time_budget_s"] == 60


def test_planner_plans_come_after_every_placements_cheap_plans(monkeypatch):
    """The planner (seconds a plan on a large world) runs after the baselines' plans and every
    placement's cheap plans, on the most promising placement first; its plans at int8
    all-to-alls are those train makes with int8 comm; a budget spent on plans drops the
    planner's plans of the least promising placements, never a placement's cheap plans."""
    from recscale.planner.cost_model import Workload
    from recscale.planner.search import plan_tables
    from recscale.sim import explore as ex
    from recscale.train.planning import table_specs, workload

    calls: list[tuple] = []
    real = ex.planner_plans

    def recorded(specs, cfg, topo, names=ex.PLANNER_PLANS):
        calls.append((topo.world_size, topo.ranks_per_host, tuple(names)))
        return real(specs, cfg, topo, names)

    monkeypatch.setattr(ex, "planner_plans", recorded)
    cfg = load_config(ROOT / "configs" / "synthetic.toml", SMALL)
    e = explore(cfg, cluster_from_dict(TIERS, "t"), time_budget_s=60, top_k=2)
    placements = {(pl.buildings * 2 * pl.ranks_per_host, pl.ranks_per_host) for pl, _ in e.plans}
    assert calls[0] == (8, 2, ("planner",)) and len(placements) == 4
    assert sorted(c[:2] for c in calls[1:]) == sorted(placements)  # then each placement once
    assert all(c[2] == ex.PLANNER_PLANS[1:] if c[:2] == (8, 2) else ex.PLANNER_PLANS for c in calls[1:])
    names = {n for (_, n) in e.plans}
    assert {"greedy-table-wise", "planner", "planner-int8-wire", "planner-tier-aware"} <= names
    full = next(pl for pl, n in e.plans if (pl.buildings, pl.ranks_per_host) == (2, 2))
    int8 = load_config(ROOT / "configs" / "synthetic.toml", SMALL + ["comm.forward=int8", "comm.backward=int8"])
    specs, wl = table_specs(int8), workload(int8)
    topo = cluster_from_dict(TIERS, "t").topology()
    assert wl != Workload(wl.batch_size)
    assert e.plans[(full, "planner-int8-wire")].to_dict() == plan_tables(specs, topo.hardware, wl).plan.to_dict()

    calls.clear()
    spent = explore(cfg, cluster_from_dict(TIERS, "t"), time_budget_s=1e-6, top_k=2)
    assert calls == [(8, 2, ("planner",))]  # the baseline's plan alone
    assert any("planner's plans not made" in n for n in spent.notes)
    assert isinstance(spent.baselines["recscale-planner"], ex.Scored)
