"""JaggedBatch: layout, transforms (select, split, to) and validation messages."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recscale.sparse import JaggedBatch, SparseInputError

FEATURES = {
    "user": [[3, 1], [], [7]],
    "item": [[0], [4, 4, 2], []],
}
WEIGHTS = {
    "user": [[0.5, 1.5], [], [2.0]],
    "item": [[1.0], [0.25, 0.75, 3.0], []],
}


def _bags(batch: JaggedBatch, key: str) -> list[list[int]]:
    values, lengths = batch[key]
    return [v.tolist() for v in torch.split(values, lengths.tolist())]


def _weight_bags(batch: JaggedBatch, key: str) -> list[list[float]]:
    assert batch.weights is not None
    idx = batch.keys.index(key)
    off = batch.offsets()
    b = batch.batch_size
    return [batch.weights[int(off[idx * b + i]) : int(off[idx * b + i + 1])].tolist() for i in range(b)]


# ---------------------------------------------------------------------------- construction and shape
def test_from_lists_layout_is_key_major():
    batch = JaggedBatch.from_lists(FEATURES, WEIGHTS)
    assert batch.keys == ("user", "item")
    assert batch.num_keys == 2 and batch.batch_size == 3
    assert batch.values.dtype == torch.int64 and batch.lengths.dtype == torch.int64
    assert batch.values.tolist() == [3, 1, 7, 0, 4, 4, 2]
    assert batch.lengths.tolist() == [2, 0, 1, 1, 3, 0]
    assert batch.weights is not None and batch.weights.dtype == torch.float32
    assert batch.weights.tolist() == [0.5, 1.5, 2.0, 1.0, 0.25, 0.75, 3.0]
    batch.validate()
    batch.validate({"user": 8, "item": 5})


def test_from_lists_unweighted_has_no_weights():
    batch = JaggedBatch.from_lists(FEATURES)
    assert batch.weights is None


def test_offsets_and_lengths_per_key():
    batch = JaggedBatch.from_lists(FEATURES)
    assert batch.offsets().tolist() == [0, 2, 2, 3, 4, 7, 7]
    assert batch.offsets().dtype == torch.int64
    assert batch.lengths_per_key() == [3, 4]


def test_getitem_returns_feature_values_and_lengths():
    batch = JaggedBatch.from_lists(FEATURES)
    v, ln = batch["item"]
    assert v.tolist() == [0, 4, 4, 2] and ln.tolist() == [1, 3, 0]
    v, ln = batch["user"]
    assert v.tolist() == [3, 1, 7] and ln.tolist() == [2, 0, 1]
    with pytest.raises(SparseInputError, match=r"feature 'nope' is not in this batch"):
        batch["nope"]


def test_all_empty_and_no_keys():
    batch = JaggedBatch.from_lists({"a": [[], []], "b": [[], []]})
    assert batch.batch_size == 2 and batch.values.numel() == 0
    assert batch.lengths_per_key() == [0, 0]
    assert batch["b"][0].numel() == 0
    batch.validate({"a": 1, "b": 1})
    assert [s.batch_size for s in batch.split([1, 1])] == [1, 1]
    empty = JaggedBatch.from_lists({})
    assert empty.num_keys == 0 and empty.batch_size == 0 and empty.lengths_per_key() == []


def test_from_dense_ids():
    ids = torch.tensor([[1, 10], [2, 20], [3, 30]], dtype=torch.int32)
    batch = JaggedBatch.from_dense_ids(["a", "b"], ids)
    assert batch.keys == ("a", "b") and batch.batch_size == 3
    assert batch.values.dtype == torch.int64
    assert batch.values.tolist() == [1, 2, 3, 10, 20, 30]
    assert batch.lengths.tolist() == [1] * 6
    assert batch.weights is None
    assert _bags(batch, "b") == [[10], [20], [30]]
    # Non-contiguous input (a transposed view) is handled too.
    t = torch.tensor([[1, 2, 3], [10, 20, 30]]).t()
    assert JaggedBatch.from_dense_ids(["a", "b"], t).values.tolist() == [1, 2, 3, 10, 20, 30]
    with pytest.raises(SparseInputError, match=r"expected shape \[batch, 2\], got \(3, 3\)"):
        JaggedBatch.from_dense_ids(["a", "b"], torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(SparseInputError, match="ids: expected shape"):
        JaggedBatch.from_dense_ids(["a"], torch.zeros(3, dtype=torch.int64))


def test_to_cpu_keeps_everything():
    batch = JaggedBatch.from_lists(FEATURES, WEIGHTS)
    moved = batch.to("cpu")
    assert moved.keys == batch.keys
    assert torch.equal(moved.values, batch.values)
    assert torch.equal(moved.lengths, batch.lengths)
    assert torch.equal(moved.weights, batch.weights)
    assert moved.values.device.type == "cpu"
    assert JaggedBatch.from_lists(FEATURES).to(torch.device("cpu")).weights is None


# ---------------------------------------------------------------------------- select
def test_select_subset_and_permutation_with_weights():
    batch = JaggedBatch.from_lists({**FEATURES, "ctx": [[9], [8, 8], [7]]},
                                   {**WEIGHTS, "ctx": [[0.1], [0.2, 0.3], [0.4]]})
    perm = batch.select(["ctx", "user"])
    assert perm.keys == ("ctx", "user") and perm.batch_size == 3
    assert perm.values.tolist() == [9, 8, 8, 7, 3, 1, 7]
    assert perm.lengths.tolist() == [1, 2, 1, 2, 0, 1]
    assert perm.weights.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 1.5, 2.0])
    perm.validate()
    single = batch.select(["item"])
    assert single.values.tolist() == [0, 4, 4, 2] and single.lengths.tolist() == [1, 3, 0]
    assert single.weights.tolist() == [1.0, 0.25, 0.75, 3.0]
    full = batch.select(["item", "ctx", "user"])
    back = full.select(batch.keys)
    assert torch.equal(back.values, batch.values) and torch.equal(back.lengths, batch.lengths)
    assert torch.equal(back.weights, batch.weights)
    assert batch.select(batch.keys) is batch or torch.equal(batch.select(batch.keys).values, batch.values)
    with pytest.raises(SparseInputError, match="'missing'"):
        batch.select(["user", "missing"])
    with pytest.raises(SparseInputError, match="duplicate"):
        batch.select(["user", "user"])


# ---------------------------------------------------------------------------- split
def test_split_explicit():
    batch = JaggedBatch.from_lists(FEATURES, WEIGHTS)
    a, b, c = batch.split([1, 0, 2])
    assert (a.batch_size, b.batch_size, c.batch_size) == (1, 0, 2)
    assert a.values.tolist() == [3, 1, 0] and a.lengths.tolist() == [2, 1]
    assert a.weights.tolist() == [0.5, 1.5, 1.0]
    assert b.values.numel() == 0 and b.lengths.numel() == 0 and b.weights.numel() == 0
    assert c.values.tolist() == [7, 4, 4, 2] and c.lengths.tolist() == [0, 1, 3, 0]
    assert c.weights.tolist() == [2.0, 0.25, 0.75, 3.0]
    for part in (a, b, c):
        part.validate({"user": 8, "item": 5})
    with pytest.raises(SparseInputError, match=r"sum to batch size 3"):
        batch.split([1, 1])
    with pytest.raises(SparseInputError, match=">= 0"):
        batch.split([4, -1])


# ---------------------------------------------------------------------------- validation messages
def test_negative_length_names_feature_and_sample():
    bad = JaggedBatch(("a", "b"), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2, -1]))
    with pytest.raises(SparseInputError, match=r"feature 'b', sample 1: negative length -1"):
        bad.validate()


def test_lengths_not_summing_to_values_count():
    bad = JaggedBatch(("a", "b"), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2, 0]))
    with pytest.raises(SparseInputError, match=r"lengths sum to 4 but there are 3 values"):
        bad.validate()
    short = JaggedBatch(("a", "b"), torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 0]))
    with pytest.raises(SparseInputError, match=r"lengths sum to 2 but there are 3 values"):
        short.validate()


def test_lengths_not_summing_to_values_count_names_a_feature():
    bad = JaggedBatch(("a", "b"), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2, 0]))
    with pytest.raises(SparseInputError, match=r"feature 'b'"):
        bad.validate()


def test_id_outside_table_names_feature():
    batch = JaggedBatch.from_lists({"a": [[0, 1], [2]], "b": [[5], []]})
    batch.validate({"a": 3, "b": 6})
    with pytest.raises(SparseInputError, match=r"feature 'b': id 5 is outside its table of 5 rows"):
        batch.validate({"a": 3, "b": 5})
    with pytest.raises(SparseInputError, match=r"feature 'a': id 2 is outside its table of 2 rows"):
        batch.validate({"a": 2, "b": 6})
    neg = JaggedBatch.from_lists({"a": [[0], [-3]], "b": [[5], []]})
    with pytest.raises(SparseInputError, match=r"feature 'a': id -3 is outside"):
        neg.validate({"a": 3, "b": 6})
    with pytest.raises(SparseInputError, match=r"feature 'b' is not served by any embedding table"):
        batch.validate({"a": 3})


def test_duplicate_keys_named():
    with pytest.raises(SparseInputError, match=r"duplicate feature names.*'x'"):
        JaggedBatch(("x", "y", "x"), torch.tensor([], dtype=torch.int64), torch.zeros(3, dtype=torch.int64))


def test_weights_shape_mismatch():
    with pytest.raises(SparseInputError, match=r"weights: shape \(2,\) must equal values shape \(3,\)"):
        JaggedBatch(("a",), torch.tensor([1, 2, 3]), torch.tensor([3]), torch.ones(2))
    with pytest.raises(SparseInputError, match=r"feature 'item', sample 1: 2 weights for 3 ids"):
        JaggedBatch.from_lists(FEATURES, {**WEIGHTS, "item": [[1.0], [1.0, 1.0], []]})


def test_unequal_sample_counts_in_from_lists():
    with pytest.raises(SparseInputError, match=r"same number of samples \(a: 2, b: 3\)"):
        JaggedBatch.from_lists({"a": [[1], [2]], "b": [[1], [], [3]]})


def test_lengths_not_multiple_of_keys_and_bad_rank():
    with pytest.raises(SparseInputError, match=r"3 entries is not a multiple of the 2 keys"):
        JaggedBatch(("a", "b"), torch.tensor([1]), torch.tensor([1, 0, 0]))
    with pytest.raises(SparseInputError, match="1-D"):
        JaggedBatch(("a",), torch.tensor([[1]]), torch.tensor([1]))


# ---------------------------------------------------------------------------- property tests
@st.composite
def batches(draw):
    k = draw(st.integers(1, 4))
    b = draw(st.integers(0, 6))
    keys = [f"k{i}" for i in range(k)]
    feats = {key: [draw(st.lists(st.integers(0, 20), max_size=4)) for _ in range(b)] for key in keys}
    weights = None
    if draw(st.booleans()):
        weights = {key: [[float(draw(st.integers(1, 8))) / 4 for _ in bag] for bag in bags]
                   for key, bags in feats.items()}
    return feats, weights


@st.composite
def splits(draw, b):
    sizes, left = [], b
    while left > 0:
        s = draw(st.integers(0, left))
        sizes.append(s)
        left -= s
    if draw(st.booleans()):
        sizes.append(0)
    return sizes or [0]


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.data())
def test_split_round_trip(spec, data):
    feats, weights = spec
    batch = JaggedBatch.from_lists(feats, weights)
    sizes = data.draw(splits(batch.batch_size))
    parts = batch.split(sizes)
    assert [p.batch_size if p.keys else 0 for p in parts] == sizes
    for p in parts:
        assert p.keys == batch.keys
        assert p.lengths.numel() == batch.num_keys * p.batch_size
        assert (p.weights is None) == (batch.weights is None)
        p.validate({key: 21 for key in batch.keys})
    for key in batch.keys:
        assert sum((_bags(p, key) for p in parts), []) == feats[key]
        if weights is not None:
            assert sum((_weight_bags(p, key) for p in parts), []) == weights[key]
    assert sum(int(p.values.numel()) for p in parts) == batch.values.numel()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.data())
def test_select_round_trip(spec, data):
    feats, weights = spec
    batch = JaggedBatch.from_lists(feats, weights)
    chosen = data.draw(st.permutations(list(batch.keys)))
    n = data.draw(st.integers(0, len(chosen)))
    sub = batch.select(chosen[:n])
    assert sub.keys == tuple(chosen[:n])
    assert sub.lengths_per_key() == [sum(len(bag) for bag in feats[key]) for key in chosen[:n]]
    sub.validate()
    for key in sub.keys:
        assert _bags(sub, key) == feats[key]
        v, ln = sub[key]
        v0, l0 = batch[key]
        assert torch.equal(v, v0) and torch.equal(ln, l0)
        if weights is not None:
            assert _weight_bags(sub, key) == weights[key]
    # A full permutation and back is the identity.
    perm = batch.select(chosen)
    back = perm.select(batch.keys)
    assert torch.equal(back.values, batch.values) and torch.equal(back.lengths, batch.lengths)
    if weights is not None:
        assert torch.equal(back.weights, batch.weights)
    # Select then split equals split then select.
    sizes = data.draw(splits(batch.batch_size))
    for a, c in zip(perm.split(sizes), batch.split(sizes)):
        c = c.select(chosen)
        assert torch.equal(a.values, c.values) and torch.equal(a.lengths, c.lengths)


@pytest.mark.parametrize("weights", [{"a": [[1.0]]}, {"a": [[1.0]], "b": []}])
def test_from_lists_weights_missing_a_feature_or_samples_names_it(weights):
    with pytest.raises(SparseInputError, match=r"feature 'b': weights must give one list per sample"):
        JaggedBatch.from_lists({"a": [[1]], "b": [[2]]}, weights)
