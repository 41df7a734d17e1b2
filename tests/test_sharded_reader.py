"""The sharded reader: every sample exactly once across ranks and workers, exact resume, shuffling."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.data.prepare import PrepareOptions, prepare
from recscale.data.prepared import PreparedDataset
from recscale.data.schema import schema_from_dict
from recscale.data.sharded_reader import ReaderStateError, ShardedReader
from dist_utils import run_ranks

N = 1000
SCHEMA = {
    "label": "y",
    "dense": [{"name": "sid", "log": False}, "x"],  # sid: the sample's row number, to identify it
    "sparse": [{"name": "a", "kind": "int", "table_rows": 50}, {"name": "tags", "kind": "int", "multi_hot": True, "table_rows": 20}],
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    rng = np.random.default_rng(0)
    tags = [rng.integers(0, 100, rng.integers(0, 4)).tolist() for _ in range(N)]
    pq.write_table(
        pa.table({
            "y": rng.integers(0, 2, N), "sid": np.arange(N, dtype=np.float64), "x": rng.random(N),
            "a": rng.integers(0, 10**6, N), "tags": pa.array(tags, pa.list_(pa.int64())),
        }),
        root / "in.parquet",
    )
    # Uneven shards (blocks of 230 rows) and row groups of 64 rows: boundaries fall everywhere.
    prepare(
        PrepareOptions(inputs=(str(root / "in.parquet"),), fmt="parquet", schema=schema_from_dict(SCHEMA),
                       out=str(root / "p"), workers=0, block_bytes=230 * 256, row_group_rows=64, progress=False),
        log=lambda _: None,
    )
    return PreparedDataset.open(root / "p")


def _sids(batches):
    return [b.dense[:, 0].long().tolist() for b in batches]


def _reader(ds, **kw):
    args = dict(batch_size=48, shuffle=True, shuffle_window=200, seed=7, chunk_rows=100)
    args.update(kw)
    return ShardedReader(ds, **args)


@settings(max_examples=25, deadline=None)
@given(
    world=st.integers(1, 4), batch=st.integers(4, 130), window=st.sampled_from([0, 1, 33, 200, 5000]),
    shuffle=st.booleans(), epoch=st.integers(0, 3), drop_last=st.booleans(),
)
def test_every_sample_once_per_epoch_across_ranks(dataset, world, batch, window, shuffle, epoch, drop_last):
    per_rank = []
    for rank in range(world):
        r = _reader(dataset, batch_size=batch, shuffle=shuffle, shuffle_window=window, rank=rank, world_size=world, drop_last=drop_last)
        r.set_epoch(epoch)
        got = _sids(r)
        assert len(got) == len(r)  # every rank yields the same number of batches
        per_rank.append([s for b in got for s in b])
    seen = [s for p in per_rank for s in p]
    assert len(seen) == len(set(seen))  # nothing twice
    if drop_last:
        assert len(seen) >= N - world * batch
    else:
        assert sorted(seen) == list(range(N))  # everything once
    # Each batch carries its jagged features consistently.
    b = next(iter(_reader(dataset, batch_size=batch, rank=0, world_size=world)))
    assert b.sparse.lengths.numel() == 2 * b.batch_size and b.sparse.values.numel() == int(b.sparse.lengths.sum())


def _rank_epoch(rank, world, root):
    ds = PreparedDataset.open(root)
    r = ShardedReader(ds, 64, rank=rank, world_size=world, shuffle=True, shuffle_window=100, seed=3, num_workers=2, chunk_rows=64)
    r.set_epoch(1)
    return {"sids": _sids(r), "len": len(r)}


def test_two_ranks_two_workers_read_each_sample_once(dataset):
    out = run_ranks(_rank_epoch, 2, str(dataset.root), timeout_s=120)
    assert out[0]["len"] == out[1]["len"] == len(out[0]["sids"]) == len(out[1]["sids"])
    a = [s for b in out[0]["sids"] for s in b]
    b = [s for b in out[1]["sids"] for s in b]
    assert not set(a) & set(b) and sorted(a + b) == list(range(N))
    # The same as one process computing both ranks with no workers.
    for rank in range(2):
        r = _reader(dataset, batch_size=64, shuffle_window=100, seed=3, chunk_rows=64, rank=rank, world_size=2)
        r.set_epoch(1)
        assert _sids(r) == out[rank]["sids"]


def _train_worker(rank, world, root):
    from recscale.train.config import load_config
    from recscale.train.loop import train

    overrides = [
        "data.source=prepared", f"data.train_path={root}", "data.num_workers=1", "data.shuffle_window=100",
        "model.table_rows=[50, 20]", "train.batch_size=64", "train.epochs=2", "train.progress=false",
        "sharding.default=row_wise", "dist.timeout_s=60",
    ]
    s = train(load_config(None, overrides), log=lambda _: None)
    return s["steps"], s["samples"], s["eval_num_samples"], s["eval_auc"]


def test_two_ranks_train_on_prepared_data(dataset):
    """torchrun-style 2-rank training reads each rank's part; ranks agree on steps and metrics."""
    a, b = run_ranks(_train_worker, 2, str(dataset.root), timeout_s=180)
    assert a == b
    assert a[:3] == (2 * (-(-900 // 64)), 2 * 900, 100)


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("stop_after", [0, 1, 2, 5, 20, 21])
def test_resume_continues_with_exactly_the_next_samples(dataset, world, rank, stop_after):
    """Two epochs read straight through equal: k batches, state saved (as JSON), a new reader
    (with worker processes) restored, the rest read."""
    full = _reader(dataset, rank=rank, world_size=world)
    straight = [b for _ in range(2) for b in _sids(full)]
    per_epoch = len(straight) // 2
    first = _reader(dataset, rank=rank, world_size=world)
    it = iter(first)
    head = [next(it).dense[:, 0].long().tolist() for _ in range(min(stop_after, per_epoch))]
    if stop_after > per_epoch:  # stop inside the second epoch
        list(it)
        it = iter(first)
        head += [next(it).dense[:, 0].long().tolist() for _ in range(stop_after - per_epoch)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = _reader(dataset, rank=rank, world_size=world, num_workers=2)
    resumed.load_state_dict(state)
    tail = _sids(resumed)
    if resumed.epoch < 2 and len(head) + len(tail) < len(straight):
        tail += _sids(resumed)
    assert head + tail == straight


def test_start_batch_matches_an_uninterrupted_epoch(dataset):
    r = _reader(dataset)
    r.set_epoch(2)
    whole = _sids(r)
    for start in (0, 3, len(whole) - 1, len(whole)):
        r.set_epoch(2)
        assert _sids(r.loader(start_batch=start)) == whole[start:]


def test_mismatched_state_is_refused(dataset):
    state = _reader(dataset).state_dict()
    with pytest.raises(ReaderStateError, match=r"seed: saved 7, now 8"):
        _reader(dataset, seed=8).load_state_dict(state)
    with pytest.raises(ReaderStateError, match=r"world_size: saved 1, now 2"):
        _reader(dataset, world_size=2).load_state_dict(state)
    with pytest.raises(ReaderStateError, match=r"shuffle_window"):
        _reader(dataset, shuffle_window=10).load_state_dict(state)
    bad = {**state, "fingerprint": {**state["fingerprint"], "dataset": "other"}}
    with pytest.raises(ReaderStateError, match=r"dataset: saved 'other'"):
        _reader(dataset).load_state_dict(bad)


def test_shuffle_is_seeded_and_changes_every_epoch(dataset):
    def order(seed, epoch, window=200):
        r = _reader(dataset, seed=seed, shuffle_window=window)
        r.set_epoch(epoch)
        return [s for b in _sids(r) for s in b]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)
    o = np.array(order(1, 0))
    assert (np.diff(o) != 1).mean() > 0.5  # samples mixed within windows, not just row groups moved
    r = _reader(dataset, shuffle=False)
    assert [s for b in _sids(r) for s in b] == list(range(N))


def test_batch_contents_match_the_source(dataset):
    src = pa.concat_tables(pq.read_table(f) for f in dataset.shard_files)
    b = next(iter(_reader(dataset, batch_size=100, shuffle=False)))
    assert torch.equal(b.labels, torch.tensor(src.column("label").to_numpy()[:100]))
    tags = src.column("tags").to_pylist()[:100]
    assert b.sparse.lengths[100:].tolist() == [len(t) for t in tags]
    assert b.sparse.values[100:].tolist() == [v for t in tags for v in t]
    assert b.sparse.values[:100].tolist() == src.column("a").to_pylist()[:100]
