"""Readers of real Criteo files, bad-row handling, synthetic data and the batch loader."""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from recscale.data import (
    ClickBatches,
    DataFormatError,
    SyntheticClickData,
    SyntheticConfig,
    make_loader,
    read_criteo_tsv,
    read_encoded_csv,
)
from recscale.train.metrics import roc_auc

CRITEO = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "criteo"
needs_criteo = pytest.mark.skipif(not CRITEO.is_dir(), reason="../shared/data/criteo is not present")
ROWS = [1000] * 26


@needs_criteo
def test_real_encoded_csv_matches_known_facts():
    train = read_encoded_csv(CRITEO / "criteo_10k_encoded_train.csv", [70000] * 26)
    test = read_encoded_csv(CRITEO / "criteo_10k_encoded_test.csv", [70000] * 26)
    assert len(train) == len(test) == 10_000
    assert abs(train.labels.mean() - 0.256) < 0.005 and abs(test.labels.mean() - 0.253) < 0.005
    assert train.sparse.shape == (10_000, 26) and train.dense.dtype == np.float32
    assert (train.dense >= 0).all()


@needs_criteo
def test_real_tsv_parses_with_hashing_and_missing_values():
    d = read_criteo_tsv(CRITEO / "kaggle_dac_sample_900.tsv", ROWS)
    assert len(d) == 900 and d.skipped_rows == 0
    assert set(np.unique(d.labels)) <= {0.0, 1.0}
    assert d.sparse.min() >= 0 and d.sparse.max() < 1000
    assert (d.sparse == 0).any()  # missing categorical values map to id 0
    no_label = read_criteo_tsv(CRITEO / "kaggle_dac_sample_100.tsv", ROWS, has_label=False)
    assert len(no_label) == 100 and no_label.labels.sum() == 0


@needs_criteo
def test_gzip_tsv_equals_plain(tmp_path):
    src = CRITEO / "kaggle_dac_sample_900.tsv"
    gz = tmp_path / "s.tsv.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    a, b = read_criteo_tsv(src, ROWS), read_criteo_tsv(gz, ROWS)
    assert np.array_equal(a.sparse, b.sparse) and np.array_equal(a.dense, b.dense)


def _tsv_row(label="1", dense="5", cat="68fd1e64"):
    return "\t".join([label] + [dense] * 13 + [cat] * 26)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("\t".join(["0"] * 39), "expected 40 tab-separated columns"),
        (_tsv_row(dense="abc"), "dense feature I1 must be a finite number, got 'abc'"),
        (_tsv_row(cat="zz12"), "categorical feature C1 must be a hex value of 1 to 16 digits, got 'zz12'"),
        (_tsv_row(label="2"), "label must be 0 or 1"),
    ],
)
def test_bad_tsv_rows_name_file_and_line(tmp_path, bad, fragment):
    p = tmp_path / "clicks.tsv"
    p.write_text("\n".join([_tsv_row(), _tsv_row(), bad, _tsv_row()]) + "\n")
    with pytest.raises(DataFormatError) as e:
        read_criteo_tsv(p, ROWS)
    assert f"clicks.tsv:3: {fragment}" in str(e.value)
    d = read_criteo_tsv(p, ROWS, skip_bad_rows=True)
    assert len(d) == 3 and d.skipped_rows == 1


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (",".join(["0"] * 39), "expected 40 comma-separated columns"),
        (",".join(["0"] * 5 + ["x"] + ["0"] * 34), "every column must be an integer, got 'x'"),
        (",".join(["0"] * 14 + ["0"] * 25 + ["999"]), "categorical feature C26: id 999 is outside its table of 50 rows"),
    ],
)
def test_bad_encoded_rows_name_file_and_line(tmp_path, bad, fragment):
    good = ",".join(["1"] * 40)
    p = tmp_path / "enc.csv"
    p.write_text("\n".join([good, bad, good]) + "\n")
    with pytest.raises(DataFormatError) as e:
        read_encoded_csv(p, [50] * 26)
    assert f"enc.csv:2: {fragment}" in str(e.value)
    d = read_encoded_csv(p, [50] * 26, skip_bad_rows=True)
    assert len(d) == 2 and d.skipped_rows == 1


# ---------------------------------------------------------------------- synthetic
CFG = SyntheticConfig(num_samples=20_000, table_rows=(100_000, 500, 10**8), pooling_factors=(1, 4, 2), seed=3)


def test_synthetic_is_deterministic_in_range_and_multi_hot():
    a = SyntheticClickData(CFG).make_samples(0, 2048)
    b = SyntheticClickData(CFG).make_samples(0, 2048)
    assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.labels, b.labels)
    for key, rows, pf in zip(a.sparse.keys, CFG.table_rows, CFG.pooling_factors):
        vals, lens = a.sparse[key]
        assert vals.min() >= 0 and vals.max() < rows
        assert abs(lens.float().mean().item() - pf) < 0.15 * pf
        if pf > 1:
            assert (lens == 0).any()  # empty bags occur
    assert 0.18 < a.labels.mean().item() < 0.32


def _per_table_block(src: SyntheticClickData, block: int):
    """Block ``block`` of the stream by the generator's formula, one table at a time."""
    from recscale.data.synthetic import BLOCK, _splitmix64, _unit, bag_lengths, scatter_ranks, zipf_ranks

    cfg = src.cfg
    rng = np.random.default_rng([cfg.seed, block * BLOCK])
    dense = np.log1p(rng.exponential(3.0, size=(BLOCK, cfg.num_dense))).astype(np.float32)
    logit = dense.astype(np.float64) @ src._dense_w
    values, lengths = [], []
    for t, (rows, pf) in enumerate(zip(cfg.table_rows, cfg.pooling_factors)):
        lens = bag_lengths(rng, BLOCK, pf)
        ids = scatter_ranks(zipf_ranks(rng, int(lens.sum()), rows, cfg.zipf_alpha), rows, src._salt[t])
        h = _splitmix64(ids.astype(np.uint64) ^ src._salt[t])
        effect = np.sqrt(-2.0 * np.log(_unit(h))) * np.cos(2.0 * np.pi * _unit(_splitmix64(h)))
        logit += src._effect_scale * (np.bincount(np.repeat(np.arange(BLOCK), lens), effect, BLOCK) / np.sqrt(pf))
        values.append(ids)
        lengths.append(lens)
    return dense, values, lengths, logit + src._bias


@pytest.mark.parametrize("alpha", [1.05, 1.0])
def test_synthetic_stream_is_the_per_table_formula(alpha):
    """All tables computed at once give bit for bit the stream of the per-table formula, also
    for a range that starts and ends inside blocks."""
    from recscale.data.synthetic import BLOCK

    cfg = SyntheticConfig(num_samples=4 * BLOCK, table_rows=(7, 1000, 1, 300_000), pooling_factors=(1, 3, 2, 1),
                          zipf_alpha=alpha, seed=4)
    src = SyntheticClickData(cfg)
    blocks = [_per_table_block(src, i) for i in (1, 2)]
    lo, hi = 100, BLOCK + 700  # samples of blocks 1 and 2
    got = src.make_samples(BLOCK + lo, hi - lo)
    ref_dense = np.concatenate([b[0] for b in blocks])[lo:hi]
    ref_logit = np.concatenate([b[3] for b in blocks])[lo:hi]
    np.testing.assert_array_equal(got.dense.numpy(), ref_dense)
    np.testing.assert_array_equal(src.planted_logits(BLOCK + lo, hi - lo), ref_logit)
    for t, key in enumerate(got.sparse.keys):
        lens = np.concatenate([b[2][t] for b in blocks])
        starts = np.concatenate([[0], np.cumsum(lens)])
        ids = np.concatenate([b[1][t] for b in blocks])[starts[lo] : starts[hi]]
        vals, got_lens = got.sparse[key]
        np.testing.assert_array_equal(got_lens.numpy(), lens[lo:hi])
        np.testing.assert_array_equal(vals.numpy(), ids)


def test_synthetic_ids_are_zipf_skewed():
    vals, _ = SyntheticClickData(CFG).make_samples(0, 20_000).sparse["s0"]
    _, counts = torch.unique(vals, return_counts=True)
    top = counts.sort(descending=True).values
    share = top[: max(1, CFG.table_rows[0] // 100)].sum().item() / vals.numel()
    assert share > 0.3  # the hottest 1% of rows get a large share of lookups


def test_synthetic_labels_are_learnable():
    data = SyntheticClickData(CFG)
    batch = data.make_samples(0, 20_000)
    auc = roc_auc(torch.from_numpy(data.planted_logits(0, 20_000)), batch.labels)
    assert auc > 0.7


# ---------------------------------------------------------------------- loader
def _collect(ds, workers):
    return [(b.labels.clone(), b.sparse.values.clone(), b.dense.clone()) for b in make_loader(ds, num_workers=workers)]


@needs_criteo
def test_loader_same_batches_with_and_without_workers():
    data = read_encoded_csv(CRITEO / "criteo_10k_encoded_train.csv", [70000] * 26)
    ds = ClickBatches(data.slice(0, 3000), batch_size=512, shuffle=True, seed=1)
    a, b = _collect(ds, 0), _collect(ds, 2)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


def test_synthetic_loader_same_batches_with_and_without_workers():
    ds = ClickBatches(SyntheticClickData(CFG), batch_size=4096, shuffle=True, seed=0)
    a, b = _collect(ds, 0), _collect(ds, 2)
    for x, y in zip(a, b):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


def test_epochs_shuffle_deterministically_and_cover_every_sample_once():
    n = 1000
    data = read_encoded_like(n)
    ds = ClickBatches(data, batch_size=64, shuffle=True, seed=5)
    seen = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        ids = torch.cat([b.dense[:, 0] for b in make_loader(ds)]).long().tolist()
        assert sorted(ids) == list(range(n))  # every sample exactly once, last batch partial
        seen.append(ids)
    assert seen[0] != seen[1]
    ds.set_epoch(0)
    assert torch.cat([b.dense[:, 0] for b in make_loader(ds)]).long().tolist() == seen[0]


def read_encoded_like(n):
    from recscale.data import ClickData

    return ClickData(
        dense=np.arange(n, dtype=np.float32).reshape(n, 1).repeat(13, 1),
        sparse=np.zeros((n, 26), dtype=np.int64),
        labels=np.zeros(n, dtype=np.float32),
    )
