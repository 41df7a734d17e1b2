"""The jagged batch type: construction, transforms and validation errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.sparse import JaggedBatch, SparseInputError


def sample():
    return JaggedBatch.from_lists(
        {"a": [[1, 2], [], [3]], "b": [[4], [5, 6, 7], []]},
        {"a": [[0.5, 1.0], [], [2.0]], "b": [[1.0], [1.0, 2.0, 3.0], []]},
    )


def test_layout_offsets_and_access():
    b = sample()
    assert b.keys == ("a", "b") and b.batch_size == 3 and b.num_keys == 2
    assert b.values.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert b.lengths.tolist() == [2, 0, 1, 1, 3, 0]
    assert b.offsets().tolist() == [0, 2, 2, 3, 4, 7, 7]
    assert b.lengths_per_key() == [3, 4]
    vals, lens = b["b"]
    assert vals.tolist() == [4, 5, 6, 7] and lens.tolist() == [1, 3, 0]
    assert b.to("cpu").values.tolist() == b.values.tolist()


def test_select_subset_and_permutation_keep_weights():
    b = sample().select(["b", "a"])
    assert b.keys == ("b", "a")
    assert b.values.tolist() == [4, 5, 6, 7, 1, 2, 3]
    assert b.lengths.tolist() == [1, 3, 0, 2, 0, 1]
    assert b.weights.tolist() == [1.0, 1.0, 2.0, 3.0, 0.5, 1.0, 2.0]
    only = sample().select(["b"])
    assert only.values.tolist() == [4, 5, 6, 7]
    with pytest.raises(SparseInputError, match="feature 'z' is not in this batch"):
        sample().select(["z"])


def test_from_dense_ids():
    b = JaggedBatch.from_dense_ids(["x", "y"], torch.tensor([[1, 2], [3, 4], [5, 6]]))
    assert b.values.tolist() == [1, 3, 5, 2, 4, 6]
    assert b.lengths.tolist() == [1] * 6


@st.composite
def batches(draw):
    k = draw(st.integers(1, 3))
    bsz = draw(st.integers(0, 5))
    feats = {f"f{i}": [draw(st.lists(st.integers(0, 9), max_size=3)) for _ in range(bsz)] for i in range(k)}
    return feats


def bags_of(batch):
    out = {}
    offs = batch.offsets().tolist()
    b = batch.batch_size
    for ki, key in enumerate(batch.keys):
        out[key] = [batch.values[offs[ki * b + i] : offs[ki * b + i + 1]].tolist() for i in range(b)]
    return out


@settings(max_examples=50, deadline=None, derandomize=True)
@given(batches(), st.data())
def test_split_round_trip(feats, data):
    batch = JaggedBatch.from_lists(feats)
    n = batch.batch_size
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    parts = batch.split(sizes)
    assert [p.batch_size for p in parts] == sizes
    joined = {k: [bag for p in parts for bag in bags_of(p)[k]] for k in batch.keys}
    assert joined == feats


@settings(max_examples=50, deadline=None, derandomize=True)
@given(batches(), st.randoms())
def test_select_permutation_round_trip(feats, rnd):
    batch = JaggedBatch.from_lists(feats)
    order = list(batch.keys)
    rnd.shuffle(order)
    back = batch.select(order).select(list(batch.keys))
    assert torch.equal(back.values, batch.values) and torch.equal(back.lengths, batch.lengths)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: JaggedBatch(("a",), torch.tensor([1]), torch.tensor([2, -1])).validate(), "feature 'a', sample 1: negative length -1"),
        (lambda: JaggedBatch(("a",), torch.tensor([1, 2, 3]), torch.tensor([1, 1])).validate(), "lengths sum to 2 but there are 3 values"),
        (lambda: JaggedBatch.from_lists({"a": [[0], [7]]}).validate({"a": 5}), "feature 'a': id 7 is outside its table of 5 rows"),
        (lambda: JaggedBatch(("a", "a"), torch.tensor([1]), torch.tensor([1, 0])), "duplicate feature names"),
        (lambda: JaggedBatch(("a",), torch.tensor([1]), torch.tensor([1]), torch.tensor([1.0, 2.0])), "weights: shape"),
        (lambda: JaggedBatch.from_lists({"a": [[1]], "b": [[1], [2]]}), "same number of samples"),
        (lambda: JaggedBatch(("a", "b"), torch.tensor([1]), torch.tensor([1, 0, 0])), "not a multiple of the 2 keys"),
        (lambda: JaggedBatch.from_lists({"a": [[1]]}).validate({"b": 3}), "feature 'a' is not served by any embedding table"),
        (lambda: sample().split([1, 1]), "sum to batch size 3"),
    ],
)
def test_errors_name_the_feature_and_problem(make, fragment):
    with pytest.raises(SparseInputError) as e:
        make()
    assert fragment in str(e.value)
