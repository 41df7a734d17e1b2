"""The SSD tier on 2 ranks: each rank's shard of a tiered table has its own file and cache,
and training is bitwise the same 2-rank run with every table in RAM (weights, optimizer state,
evaluation metrics), for table-wise, row-wise, column-wise and table-row-wise tables."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks
from recscale.comm.collectives import CommStats
from recscale.comm.dense_sync import DenseGradSync
from recscale.comm.process_group import env_topology, init_process_groups
from recscale.embedding import SGD, TableConfig
from recscale.embedding.tier_hooks import close_tiers, tier_stats, tiered_storages
from recscale.train.config import ConfigError, load_config
from recscale.train.datasets import build_data
from recscale.train.evaluation import evaluate
from recscale.train.loop import seed_everything, train
from recscale.train.model_factory import build_dense_optimizer, build_model
from recscale.train.pipeline import TrainPipeline, train_step
from recscale.train.tiers import tier_factory, tier_summary

BASE = [
    "data.source=synthetic",
    "data.eval_samples=256",
    "data.pooling_factors=[1, 3, 2]",
    "data.num_workers=0",
    "model.table_rows=[300, 900, 60]",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "train.batch_size=16",  # per rank: 32 samples a step
    "train.progress=false",
    "train.threads=1",
]
# Caches per rank's shard: t_s0 40 of 300 rows, t_s1 120 of 900 (or of its row shard).
CACHES = '{ t_s0 = { placement = "ssd", cache_rows = 40 }, t_s1 = { placement = "ssd", cache_rows = 120 } }'


def _tiers(ssd_dir: str, policy: str) -> list[str]:
    return [f"tiers.ssd_dir={ssd_dir}", f"tiers.policy={policy}", "tiers.lookahead_batches=2", "tiers.io_threads=2",
            f"tiers.tables={CACHES}"]


def _run(overrides: list[str], steps: int, watch: list | None = None) -> dict:
    """Train ``steps`` steps as ``recscale train`` does; every table and its state (whole),
    the dense parameters, evaluation metrics, the tier's counters and this rank's files.
    ``watch``: gets the tier's events (announce, begin, training lookup) in order."""
    cfg = load_config(None, BASE + overrides)
    groups = init_process_groups(env_topology(), 60.0, device=torch.device("cpu"))
    seed_everything(cfg.train.seed)
    data = build_data(cfg, groups.rank, groups.world_size)
    stats = CommStats()
    model = build_model(cfg, data.sparse_names, data.num_dense, groups.device, groups, stats)
    params = model.dense_parameters()
    opt = build_dense_optimizer(cfg, params)
    sync = DenseGradSync(params, groups.dense, "fp32", 1.0, stats)
    if watch is not None:
        _watch(model.embeddings, watch)
    done = 0
    with closing(TrainPipeline(data.train_loader(), model.embeddings, groups.device, cfg.train.pipeline,
                               cfg.tiers.lookahead_batches)) as pipe:
        for batch, sparse in pipe:
            train_step(model, batch, sparse, opt, sync)
            done += 1
            if done == steps:
                break
    emb = model.embeddings
    out: dict = {"dense": [p.detach().clone() for p in params], "steps": done}
    for t in emb.tables:
        out[t.name] = emb.full_table(t.name)
        out[t.name + ".state"] = emb.full_state(t.name)
    m = evaluate(model, data.eval_loader(), groups.device, groups.dense)
    out["eval"] = m.as_dict()
    out["files"] = sorted(seg.file.path.name for _, st in tiered_storages(emb) for seg in st.segments)
    out["stats"] = tier_stats(emb)
    out["summary"] = tier_summary(emb, done, 1.0, groups.dense) if cfg.tiers.enabled() else {}
    close_tiers(emb)
    return out


def _watch(emb, events: list) -> None:
    """Record the first tiered group's announced rows, batch starts and training lookups."""
    _, st = tiered_storages(emb)[0]
    announce, begin, slots_for = st.announce, st.begin_batch, st.slots_for

    def on_announce(rows):
        events.append(("announce", torch.unique(rows)))
        announce(rows)

    def on_begin():
        events.append(("begin", None))
        begin()

    def on_lookup(rows):
        if torch.is_grad_enabled():
            events.append(("lookup", torch.unique(rows)))
        return slots_for(rows)

    st.announce, st.begin_batch, st.slots_for = on_announce, on_begin, on_lookup


def _schedules(rank: int, world: int, ssd_dir: str) -> dict[int, list]:
    out = {}
    for lookahead in (1, 3):
        d = Path(ssd_dir) / f"k{lookahead}"  # shared by the ranks
        d.mkdir(exist_ok=True)
        over = ["sharding.default=row_wise", "data.num_samples=192", "embedding_optimizer.name=sgd"]
        out[lookahead] = []
        _run(over + _tiers(str(d), "lookahead") + [f"tiers.lookahead_batches={lookahead}"], 12, out[lookahead])
    return out


def test_each_rank_announces_the_ids_it_receives_k_batches_ahead(tmp_path):
    """Before batch i trains, batches i..i+k are announced, each with exactly the rows this
    rank's shard then looks up (the ids after the input all-to-all, not the rank's own batch)."""
    for by_lookahead in run_ranks(_schedules, 2, str(tmp_path), timeout_s=120):
        for lookahead, events in by_lookahead.items():
            announced = [rows for kind, rows in events if kind == "announce"]
            looked_up = [rows for kind, rows in events if kind == "lookup"]
            assert len(announced) == len(looked_up) == 12
            assert all(torch.equal(a, b) for a, b in zip(announced, looked_up))
            seen, begun = 0, 0
            for kind, _ in events:
                seen += kind == "announce"
                begun += kind == "begin"
                if kind == "begin":
                    assert seen == min(begun + lookahead, 12), (lookahead, begun, seen)


def _variants(rank: int, world: int, sharding: list[str], runs: list[tuple[str, str]], ssd_dir: str,
              steps: int) -> dict:
    """Each optimizer all in RAM, then on the tier with each of its policies."""
    out = {}
    for name, policy in runs:
        opt = [f"embedding_optimizer.name={name}"]
        if (name, "ram") not in out:
            out[(name, "ram")] = _run(sharding + opt, steps)
        d = Path(ssd_dir) / f"{name}-{policy}"  # shared by the ranks
        d.mkdir(exist_ok=True)
        out[(name, policy)] = _run(sharding + opt + _tiers(str(d), policy), steps)
    return out


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a["steps"] == b["steps"]
    for x, y in zip(a["dense"], b["dense"]):
        assert torch.equal(x, y), f"{what}: dense parameters differ"
    for k in a:
        if k.startswith("t_"):
            if isinstance(a[k], dict):
                assert a[k].keys() == b[k].keys()
                for s in a[k]:
                    assert torch.equal(a[k][s], b[k][s]), f"{what}: {k} {s} differs"
            else:
                assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
    assert a["eval"] == b["eval"], what


def _check(results: list[dict], steps: int, runs: list[tuple[str, str]], files: set[str]) -> None:
    for name, policy in runs:
        ram = [r[(name, "ram")] for r in results]
        assert ram[0]["steps"] == steps and not ram[0]["files"]
        tier = [r[(name, policy)] for r in results]
        for rank in range(2):
            _assert_bitwise(tier[rank], ram[rank], f"{name}/{policy} rank {rank}")
        # Each rank's shards have their own files: none shared, named by table, shard and rank.
        mine = [set(t["files"]) for t in tier]
        assert not (mine[0] & mine[1])
        assert mine[0] | mine[1] == files
        for rank, names in enumerate(mine):
            assert all(f".r{rank}." in n for n in names)
        # The summary is the job's: hit rate over every rank's lookups, MiB per step summed.
        st = [t["stats"] for t in tier if t["stats"] is not None]
        lookups, hits = sum(s.lookups for s in st), sum(s.hits for s in st)
        summary = tier[0]["summary"]
        assert summary == tier[1]["summary"]
        assert summary["cache_hit_rate"] == hits / lookups and 0 < hits < lookups
        assert summary["ssd_read_mb_per_step"] == sum(s.read_bytes for s in st) / 2**20 / steps > 0
        assert summary["prefetched_rows"] == sum(s.prefetched_rows for s in st) > 0


# The smallest cache (40 rows, up to 32 ids a step) turns over many times in 60 steps: each
# policy evicts, writes back and reads again rows it trained, which a longer run only repeats.
STEPS = 60


# Between them the two tests cover each of SGD and row-wise Adagrad with each of lookahead and lru.
@pytest.mark.parametrize("sharding, runs, files", [
    ("table_wise", [("sgd", "lookahead"), ("rowwise_adagrad", "lru")], {"t_s0.s0.r1.0.tier", "t_s1.s0.r0.0.tier"}),
    ("row_wise", [("sgd", "lru"), ("rowwise_adagrad", "lookahead")],
     {"t_s0.s0.r0.0.tier", "t_s0.s1.r1.150.tier", "t_s1.s0.r0.0.tier", "t_s1.s1.r1.450.tier"}),
])
def test_two_ranks_on_the_tier_equal_two_ranks_in_ram(tmp_path, sharding, runs, files):
    """Bitwise the same 2-rank run all in RAM: weights, optimizer state, evaluation metrics."""
    results = run_ranks(_variants, 2, [f"sharding.default={sharding}", f"data.num_samples={STEPS * 16}"], runs,
                        str(tmp_path), STEPS, timeout_s=300)
    _check(results, STEPS, runs, files)


def test_column_and_table_row_shards_on_the_tier_equal_ram(tmp_path):
    """Column-wise (row-wise Adagrad: its row statistic summed over the column shards) and
    table-row-wise tables, with a data-parallel one left in RAM; fp16 rows (the torch kernels);
    Adam and Adagrad too; fewer steps."""
    sharding = ["sharding.default=table_wise",
                'sharding.tables={ t_s0 = { type = "column_wise", shards = 2 }, t_s1 = { type = "table_row_wise" }, '
                't_s2 = { type = "data_parallel" } }', "data.num_samples=480", "model.embedding_dtype=fp16"]
    runs = [("rowwise_adagrad", "lfu"), ("adam", "lookahead"), ("adagrad", "lru")]
    results = run_ranks(_variants, 2, sharding, runs, str(tmp_path), 30, timeout_s=300)
    _check(results, 30, runs, {"t_s0.s0.r0.0.tier", "t_s0.s1.r1.0.tier", "t_s1.s0.r0.0.tier", "t_s1.s1.r1.450.tier"})


def _train(rank: int, world: int, overrides: list[str]) -> dict:
    return train(load_config(None, BASE + overrides), log=lambda _: None)


def test_recscale_train_on_two_ranks_reports_the_jobs_tier_figures(tmp_path):
    """The training loop at 2 ranks: the same metrics as in RAM, the figures reduced over ranks
    (so both ranks report the same), each rank's files closed under their own names."""
    over = ["sharding.default=row_wise", "data.num_samples=320", "train.eval_every_steps=10"]
    # One run per process start: each runs ``recscale train`` as a job would.
    rams = run_ranks(_train, 2, over, timeout_s=120)
    tiers = run_ranks(_train, 2, over + _tiers(str(tmp_path), "lookahead"), timeout_s=120)
    results = list(zip(rams, tiers))
    for ram, tier in results:
        assert tier["steps"] == ram["steps"] == 20
        for k in ("eval_auc", "eval_logloss", "eval_ne", "train_logloss"):
            assert tier[k] == ram[k], k
        assert tier["evals"] == ram["evals"]
        assert 0 < tier["cache_hit_rate"] < 1 and tier["ssd_write_mb_per_step"] > 0
        assert 0 <= tier["io_stall_fraction"] < 1 and tier["prefetched_rows"] > 0
        assert "cache_hit_rate" not in ram
    figures = ("cache_hit_rate", "ssd_read_mb_per_step", "ssd_write_mb_per_step", "io_stall_fraction",
               "prefetched_rows")
    assert [results[0][1][k] for k in figures] == [results[1][1][k] for k in figures]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "t_s0.s0.r0.0.tier", "t_s0.s1.r1.150.tier", "t_s1.s0.r0.0.tier", "t_s1.s1.r1.450.tier"]


def test_a_data_parallel_table_stays_in_ram(tmp_path):
    """Replicated tables are held whole on every rank: never on the tier."""
    tables = [TableConfig("t_rep", 40_000, 8), TableConfig("t_sh", 30_000, 8)]  # 1.22 and 0.92 MiB with SGD
    cfg = load_config(None, BASE + [f"tiers.ssd_dir={tmp_path}", 'tiers.tables={ t_rep = { placement = "ssd" } }'])
    with pytest.raises(ConfigError, match=r"tiers.tables.t_rep.placement': table 't_rep' is data_parallel"):
        tier_factory(cfg, tables, SGD(), world_size=2, replicated={"t_rep"})
    # With a budget that holds one table whole, the replicated one stays in RAM and the other
    # goes to the tier, its cache within what the budget leaves.
    cfg = load_config(None, BASE + [f"tiers.ssd_dir={tmp_path}", "tiers.ram_budget_mb=2"])
    placed = tier_factory(cfg, tables, SGD(), world_size=2, replicated={"t_rep"}).placement
    assert placed["t_rep"] == ("ram", 0) and placed["t_sh"][0] == "ssd"
    assert 0 < placed["t_sh"][1] <= (2 * 2**20 - 40_000 * 32) // 32


def test_a_shard_on_the_tier_starts_from_the_whole_tables_rows_and_names_it_in_errors(tmp_path):
    """A row-and-column shard's file holds the rectangle of the whole table's initial rows, and
    a cache too small for a batch names the table's config key and the shard's file."""
    from recscale.embedding import TableBatchedEmbeddingBags
    from recscale.embedding.table_batched import init_rows
    from recscale.embedding.tier_file import TierError
    from recscale.embedding.tiered import TierSettings, TierShard, tiered_storage_factory
    from recscale.sparse import JaggedBatch

    whole = TableConfig("t_big", 1000, 8, ("big",))
    part = TableConfig("t_big#1", 300, 4, ("big#1",))
    factory = tiered_storage_factory({"t_big": ("ssd", 5)}, TierSettings(str(tmp_path), "lru", 2, 0), seed=3)
    factory = factory.for_shards({part.name: TierShard(whole, 600, 4, "t_big.s1.r1")})
    tbe = TableBatchedEmbeddingBags([part], SGD(), seed=3, storage_factory=factory)
    assert torch.equal(tbe.table_weight(part.name), init_rows(whole, 3, 600, 300, 4, 4))
    assert [p.name for p in tmp_path.iterdir()] == ["t_big.s1.r1.600.tier"]
    batch = JaggedBatch(("big#1",), torch.arange(6), torch.ones(6, dtype=torch.int64))
    msg = r"table 't_big' \(its shard t_big.s1.r1\): .* tiers.tables.t_big.cache_rows >= 6"
    with pytest.raises(TierError, match=msg):
        tbe(batch)
    close_tiers(tbe)
