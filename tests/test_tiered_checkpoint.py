"""Checkpoints of tables on the SSD tier: a resumed run is bitwise the uninterrupted one, a
differential checkpoint holds (and reads) only the rows changed since the last one, whether
they are cached or were written back to the tier file, checkpoints restore across placements,
and a tier file left by an earlier run is rebuilt, never trusted."""

from __future__ import annotations

import json

import pytest
import torch

from recscale.checkpoint.lineage import resolve
from recscale.checkpoint.manifest import checkpoint_name
from recscale.checkpoint.restore import load_manifest
from recscale.checkpoint.tools import assemble
from recscale.train.config import load_config
from recscale.train.loop import train

BASE = [
    "data.source=synthetic",
    "data.num_samples=1920",  # 120 steps of 16
    "data.eval_samples=128",
    "data.pooling_factors=[1, 3, 2]",
    "data.num_workers=0",
    "model.table_rows=[300, 900, 60]",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "train.batch_size=16",
    "train.eval_every_steps=50",
    "train.progress=false",
    "train.threads=1",
]
# Caches far smaller than the tables: most rows are evicted (and written back) between checkpoints.
TABLES = '{ t_s0 = { placement = "ssd", cache_rows = 24 }, t_s1 = { placement = "ssd", cache_rows = 64 } }'


def tiered(ssd_dir, policy: str = "lookahead") -> list[str]:
    return [f"tiers.ssd_dir={ssd_dir}", f"tiers.policy={policy}", "tiers.lookahead_batches=2", "tiers.io_threads=2",
            f"tiers.tables={TABLES}"]


def checkpointed(ck, policy: str = "incremental", interval: int = 20) -> list[str]:
    return [f"checkpoint.dir={ck}", f"checkpoint.policy={policy}", f"checkpoint.interval_steps={interval}",
            "checkpoint.keep_last=0", "checkpoint.quantization=none"]


def quiet(opts: list[str]) -> dict:
    return train(load_config(None, opts), log=lambda _: None)


def final_state(ck) -> dict[str, torch.Tensor]:
    """Every table's rows and state and the dense parameters at the newest checkpoint."""
    storage, name = resolve(str(ck))
    return assemble(storage, load_manifest(storage, name))


def assert_same_run(a: dict, b: dict) -> None:
    for k in ("eval_auc", "eval_logloss", "eval_ne", "train_logloss", "steps", "samples"):
        assert a[k] == b[k], k
    assert a["evals"] == b["evals"]


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_resume_on_the_tier_is_bitwise_the_uninterrupted_run(tmp_path, optimizer):
    opt = [f"embedding_optimizer.name={optimizer}"]
    for d in ("ssd_a", "ssd_b"):
        (tmp_path / d).mkdir()
    whole = quiet(BASE + opt + tiered(tmp_path / "ssd_a") + checkpointed(tmp_path / "a"))
    first = quiet(BASE + opt + tiered(tmp_path / "ssd_b") + checkpointed(tmp_path / "b")
                  + ["train.max_steps=50", "checkpoint.at_end=false"])
    assert first["steps"] == 50
    # The tier file of the stopped run stays behind, not closed cleanly if it had crashed:
    # the resumed run rebuilds it and takes its rows from the checkpoint (step 40, a differential).
    notes: list[str] = []
    resumed = train(load_config(None, BASE + opt + tiered(tmp_path / "ssd_b") + checkpointed(tmp_path / "b")
                                + ["checkpoint.resume=latest"]), log=notes.append)
    assert any(n.startswith("tiers: rebuilding the tier files") for n in notes), notes
    assert resumed["restore_chain"] == [checkpoint_name(20), checkpoint_name(40)]
    assert_same_run(whole, resumed)
    assert_same_state(final_state(tmp_path / "a"), final_state(tmp_path / "b"))
    # ...and the same as the run with every table in RAM.
    ram = quiet(BASE + opt + checkpointed(tmp_path / "ram"))
    assert_same_run(ram, whole)
    assert_same_state(final_state(tmp_path / "ram"), final_state(tmp_path / "a"))


@pytest.fixture
def dirs(tmp_path):
    for d in ("ssd", "ssd2"):
        (tmp_path / d).mkdir()
    return tmp_path


def test_differential_checkpoints_hold_the_changed_rows_cached_or_written_back(dirs):
    """Each differential holds exactly the rows the RAM run's tracker marks, though most of
    them left the tiny caches (written back to the file) before the checkpoint."""
    runs = {}
    for name, opts in (("ram", []), ("tier", tiered(dirs / "ssd"))):
        runs[name] = quiet(BASE + ["train.max_steps=60", "embedding_optimizer.name=rowwise_adagrad"] + opts
                           + checkpointed(dirs / name, "incremental", 20))
    for name in ("ram", "tier"):
        kinds = [c["kind"] for c in runs[name]["checkpoints"]]
        assert kinds == ["full", "incremental", "incremental"], kinds
    for a, b in zip(runs["ram"]["checkpoints"], runs["tier"]["checkpoints"]):
        assert a["bytes_written_rank"] == b["bytes_written_rank"], (a, b)
    chunks = {}
    for name in ("ram", "tier"):
        (run,) = (dirs / name).glob("run-*")
        for step in (40, 60):
            m = json.loads((run / checkpoint_name(step) / "manifest.json").read_text())
            assert 0 < m["training"]["changed_fraction"] < 0.5
            chunks[name, step] = [(c["table"], c["row_start"], c["num_rows"], c["crc32"]) for c in m["chunks"]]
    # The same rows with the same bytes, far fewer than the 1260 rows of the tables.
    assert chunks["ram", 40] == chunks["tier", 40] and chunks["ram", 60] == chunks["tier", 60]
    assert sum(c[2] for c in chunks["tier", 40]) < 1260 / 2
    assert_same_state(final_state(dirs / "ram"), final_state(dirs / "tier"))


def test_a_differential_snapshot_reads_only_the_changed_rows(dirs):
    """The snapshot of a differential reads the changed rows from the cache or the file, not
    the whole table: the file reads at most the changed rows (those not cached)."""
    from recscale.checkpoint.manager import CheckpointManager
    from recscale.checkpoint.settings import CheckpointSettings
    from recscale.checkpoint.shards import local_shards
    from recscale.checkpoint.storage import LocalStorage
    from recscale.sparse import JaggedBatch
    from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
    from recscale.embedding.tier_hooks import close_tiers, tiered_storages
    from recscale.embedding.tiered import TierSettings, tiered_storage_factory

    tables = [TableConfig("big", 5000, 8, features=("f",))]
    factory = tiered_storage_factory({"big": ("ssd", 16)}, TierSettings(str(dirs / "ssd"), "lru", 0, 0), seed=3)
    emb = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=3, storage_factory=factory)
    (_, st), = tiered_storages(emb)
    settings = CheckpointSettings(dir=str(dirs / "ck"), policy="incremental", interval_steps=1, async_write=False,
                                  quantization="none")
    m = CheckpointManager(settings, LocalStorage(dirs / "ck"), local_shards(emb), init_seed=3)
    m.save(0, b"", {"step": 0})
    g = torch.Generator().manual_seed(0)
    changed: set[int] = set()
    for _ in range(6):  # 6 x 10 ids over 5000 rows through a 16-row cache: evictions, write-backs
        ids = torch.randint(0, 5000, (10,), generator=g)
        changed |= set(ids.tolist())
        emb(JaggedBatch(("f",), ids, torch.ones(10, dtype=torch.int64))).sum().backward()
    file, reads = st.segments[0].file, []  # rows read from the tier file by the snapshot
    plain_read = file.read
    file.read = lambda rows, out, advise=True: (reads.append(rows.size), plain_read(rows, out, advise))[1]
    m.save(1, b"", {"step": 1})
    file.read = plain_read
    held = st.segments[0].row_of_slot
    evicted = changed - set(held[held >= 0].tolist())
    assert sum(reads) == len(evicted) > 0  # the changed rows that left the cache since, no others
    report = m.finish()[-1]
    assert report.kind == "incremental" and report.rows_written == len(changed)
    close_tiers(emb)


@pytest.mark.parametrize("src, dst", [("tier", "ram"), ("ram", "tier")])
def test_checkpoints_restore_across_placements(dirs, src, dst):
    place = {"tier": tiered(dirs / "ssd", "lru"), "ram": []}  # one_shot: restore = baseline + latest
    opt = ["embedding_optimizer.name=rowwise_adagrad"]
    whole = quiet(BASE + opt + place[dst] + checkpointed(dirs / "a", "one_shot"))
    quiet(BASE + opt + place[src] + checkpointed(dirs / "b", "one_shot") + ["train.max_steps=70",
                                                                                  "checkpoint.at_end=false"])
    resumed = quiet(BASE + opt + place[dst] + checkpointed(dirs / "b", "one_shot") + ["checkpoint.resume=latest"])
    assert resumed["restore_chain"] == [checkpoint_name(20), checkpoint_name(60)]
    assert_same_run(whole, resumed)
    assert_same_state(final_state(dirs / "a"), final_state(dirs / "b"))


def test_a_stale_tier_file_is_rebuilt_not_trusted(dirs):
    """A tier file of another seed, or with garbage rows (a crashed run), is replaced by a
    fresh one: the run is bitwise a run on an empty ssd_dir, and says what it rebuilt."""
    opt = ["embedding_optimizer.name=sgd", "train.max_steps=30"]
    clean = quiet(BASE + opt + tiered(dirs / "ssd2"))
    quiet(BASE + opt + ["train.seed=7"] + tiered(dirs / "ssd"))  # another seed's files, closed cleanly
    path = dirs / "ssd" / "t_s0.0.tier"
    with path.open("r+b") as f:  # rows of a crash: garbage past the header, header not clean
        header = f.read(4096)
        f.write(b"\xff" * 4096)
        f.seek(0)
        f.write(header.replace(b'"clean": true', b'"clean": false')[:4096])
    notes: list[str] = []
    again = train(load_config(None, BASE + opt + tiered(dirs / "ssd")), log=notes.append)
    (line,) = [n for n in notes if n.startswith("tiers: rebuilding")]
    assert "t_s0.0.tier (not closed cleanly)" in line and "t_s1.0.tier (closed cleanly)" in line
    assert_same_run(clean, again)


@pytest.mark.parametrize("policy, codec", [("intermittent", "mixed"), ("one_shot", "uniform"), ("full", "fp16")])
def test_every_policy_and_codec_writes_what_the_ram_run_writes(dirs, policy, codec):
    """The tier hands the checkpoint the same rows as RAM, so every policy and codec writes the
    same chunks, byte for byte."""
    crcs = []
    for name, opts in (("ram", []), ("tier", tiered(dirs / "ssd"))):
        quiet(BASE + ["train.max_steps=30", "embedding_optimizer.name=rowwise_adagrad"] + opts
              + checkpointed(dirs / name, policy, 10)[:-1] + [f"checkpoint.quantization={codec}"])
        (run,) = (dirs / name).glob("run-*")
        manifests = {d.name: json.loads((d / "manifest.json").read_text()) for d in sorted(run.glob("step*"))}
        crcs.append({k: [(c["table"], c["num_rows"], c["crc32"]) for c in m["chunks"]] for k, m in manifests.items()})
    assert crcs[0] == crcs[1] and len(crcs[0]) == 3


def test_a_tiered_checkpoint_resumes_on_two_ranks(tmp_path):
    """Written at world size 1 with tables on the tier, restored at world size 2 (tables in RAM,
    sharded row-wise): the same run within 1e-6, as for a checkpoint of tables in RAM."""
    from ckpt_utils import TINY, rank_runs, run_training
    from dist_utils import run_ranks

    (tmp_path / "ssd").mkdir()
    full1, s_full1, _ = run_training([])
    tables = '{ t_s0 = { placement = "ssd", cache_rows = 300 }, t_s1 = { placement = "ssd", cache_rows = 1024 } }'
    train(load_config(None, TINY + [f"tiers.ssd_dir={tmp_path / 'ssd'}", f"tiers.tables={tables}",
                                    f"checkpoint.dir={tmp_path / 'ck'}", "train.max_steps=8",
                                    "checkpoint.interval_steps=4", "checkpoint.policy=one_shot"]), log=lambda _: None)
    res = run_ranks(rank_runs, 2, [["sharding.default=row_wise", f"checkpoint.resume={tmp_path / 'ck'}"]],
                    timeout_s=180)
    resumed, s_res, _ = res[0][0]
    assert resumed["restore_world_size"] == 1 and resumed["restore_chain"] == [checkpoint_name(4), checkpoint_name(8)]
    assert resumed["steps"] == full1["steps"]
    assert s_res.keys() == s_full1.keys()
    for k in s_res:
        err = float((s_res[k].double() - s_full1[k].double()).norm() / s_full1[k].double().norm().clamp(min=1e-30))
        assert err <= 1e-6, (k, err)


def test_the_snapshot_sees_the_newest_copy_with_write_backs_in_flight(tmp_path, monkeypatch):
    """At each checkpoint (write-backs of the rows just evicted still running, slowly, in the
    background) the tracker marks the rows the RAM tracker marks, evicted ones included, and
    reading them, or the whole table, gives the RAM rows bitwise: the snapshot waits for the
    write-back it needs."""
    import threading
    import time

    from recscale.checkpoint.shards import local_shards
    from recscale.checkpoint.tracker import RowTracker
    from recscale.embedding import RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
    from recscale.embedding.tier_file import RowFile
    from recscale.embedding.tier_hooks import close_tiers, tier_stats
    from recscale.embedding.tiered import TierSettings, tiered_storage_factory
    from recscale.sparse import JaggedBatch

    real_write = RowFile.write

    def slow_write(self, *args):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        real_write(self, *args)

    monkeypatch.setattr(RowFile, "write", slow_write)
    t = TableConfig("t", 40, 4, ("f",))
    ram = TableBatchedEmbeddingBags([t], RowWiseAdagrad(lr=0.5), seed=1)
    factory = tiered_storage_factory({"t": ("ssd", 6)}, TierSettings(str(tmp_path), "lru", 0, 2), seed=1)
    tier = TableBatchedEmbeddingBags([t], RowWiseAdagrad(lr=0.5), seed=1, storage_factory=factory)
    shards = {m: local_shards(m) for m in (ram, tier)}
    trackers = {m: RowTracker(shards[m]) for m in (ram, tier)}
    g = torch.Generator().manual_seed(0)
    for step in range(1, 19):
        batch = JaggedBatch(("f",), torch.randint(0, 40, (5,), generator=g), torch.ones(5, dtype=torch.int64))
        for m in (ram, tier):
            m(batch).sum().backward()
        if step % 3:
            continue
        # A checkpoint every 3 steps: rows changed since the last one (incremental) and since the
        # first (differential) were mostly evicted since, some still being written back.
        for kind in ("incremental", "differential"):
            masks = [trackers[m].shard_mask(shards[m][0], kind) for m in (ram, tier)]
            assert torch.equal(masks[0], masks[1]), kind
            changed = masks[0].nonzero().view(-1)
            for local in (changed, None):
                (w0, s0), (w1, s1) = (shards[m][0].read_rows(local) for m in (ram, tier))
                assert torch.equal(w0, w1) and s0.keys() == s1.keys()
                assert all(torch.equal(s0[k], s1[k]) for k in s0)
        for m in (ram, tier):
            trackers[m].advance("incremental")
    assert tier_stats(tier).write_bytes > 0
    close_tiers(tier)
