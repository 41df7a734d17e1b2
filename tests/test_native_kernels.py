"""The native CPU embedding kernels give the same results as the pure-PyTorch kernels.

Both sum every bag and every unique row's gradients in the same order, so the pooled outputs,
the summed row gradients and SGD updates are bitwise equal in fp32. The Adagrad variants and
Adam take a square root, which ATen computes with a vectorised approximation a few ulps off
IEEE, so those are compared with a tight tolerance. The module compiles once per machine and
test session (cached).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.embedding import SGD, Adagrad, Adam, RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig, native
from recscale.embedding.table_batched import row_gradients
from recscale.sparse import JaggedBatch, SparseInputError

import proc_utils

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.failure()}")

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.1, eps=1e-8),
    "adagrad": lambda: Adagrad(lr=0.1, eps=1e-8),
    "adam": lambda: Adam(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8),
}
EXACT = {"sgd"}  # no square root in the update


def _pair(tables, opt_name, seed=3, **kw):
    return {k: TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt_name](), seed=seed, kernel=k, **kw) for k in ("native", "torch")}


def _random_batch(features: dict[str, int], batch_size: int, gen: torch.Generator, weighted: bool, max_len=5):
    ids, wts = {}, {}
    for f, rows in features.items():
        bags = []
        for _ in range(batch_size):
            n = int(torch.randint(0, max_len + 1, (), generator=gen))
            # a narrow id range, so bags repeat rows and rows repeat across bags and features
            bags.append(torch.randint(0, min(rows, 6), (n,), generator=gen).tolist())
        ids[f] = bags
        wts[f] = [torch.rand(len(b), generator=gen).add(0.25).tolist() for b in bags]
    return JaggedBatch.from_lists(ids, wts if weighted else None)


def _assert_same(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7, msg=what)


def _run_steps(pair, batches, gen, exact: bool) -> None:
    for step, batch in enumerate(batches):
        outs = {k: m(batch) for k, m in pair.items()}
        # the forward reads the weights the previous steps wrote: exact only while those are
        _assert_same(outs["native"], outs["torch"], exact, f"step {step} pooled output")
        grad = torch.randn(outs["torch"].shape, generator=gen)
        for o in outs.values():
            o.backward(grad)
        n, t = pair["native"], pair["torch"]
        for tab in n.tables:
            _assert_same(n.table_weight(tab.name), t.table_weight(tab.name), exact, f"step {step} {tab.name} weights")
            for k, v in n.table_state(tab.name).items():
                _assert_same(v, t.table_state(tab.name)[k], exact, f"step {step} {tab.name} {k}")
        assert [g.step for g in n.groups] == [g.step for g in t.groups]


TABLES = [
    TableConfig("a", 40, 128, features=("f1", "f2")),  # two features share one table
    TableConfig("b", 25, 128, features=("f3",), pooling="mean"),
    TableConfig("c", 30, 16, features=("f4",)),  # a second group (another dim)
    TableConfig("d", 9, 5, features=("f5",), pooling="mean"),  # a dim with no specialisation
]
FEATURES = {"f1": 40, "f2": 40, "f3": 25, "f4": 30, "f5": 9}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("weighted", [False, True])
def test_native_equals_torch_over_several_steps(opt_name, weighted):
    gen = torch.Generator().manual_seed(7)
    pair = _pair(TABLES, opt_name)
    batches = [_random_batch(FEATURES, 6, gen, weighted) for _ in range(4)]
    _run_steps(pair, batches, gen, exact=opt_name in EXACT)


@settings(max_examples=25, deadline=None)
@given(
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    dim=st.sampled_from([1, 3, 16, 64]),
    pooling=st.sampled_from(["sum", "mean"]),
    batch_size=st.integers(1, 5),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_equals_torch_property(opt_name, dim, pooling, batch_size, weighted, seed):
    tables = [TableConfig("t", 7, dim, features=("x", "y"), pooling=pooling), TableConfig("u", 3, dim, features=("z",))]
    gen = torch.Generator().manual_seed(seed)
    pair = _pair(tables, opt_name, seed=seed)
    batches = [_random_batch({"x": 7, "y": 7, "z": 3}, batch_size, gen, weighted) for _ in range(2)]
    _run_steps(pair, batches, gen, exact=opt_name in EXACT)


def test_summed_row_gradients_are_bitwise_equal():
    """The native grouping sums each row's gradients in the torch kernel's order, exactly."""
    gen = torch.Generator().manual_seed(1)
    m = TableBatchedEmbeddingBags(TABLES[:2], SGD(lr=0.1), kernel="native")
    g = m.groups[0]
    for weighted in (False, True):
        batch = _random_batch({"f1": 40, "f2": 40, "f3": 25}, 9, gen, weighted, max_len=12)
        grad = torch.randn(batch.batch_size, 3 * 128, generator=gen)
        u, s = native.load().row_gradients(
            grad, batch.values, batch.offsets(), batch.batch_size, g.feature_index(batch.keys), g.feature_row_offset,
            g.feature_mean_u8, batch.weights, g.num_rows, g.dim,
        )  # fmt: skip
        # the torch path's inputs: rows in sample-major order, mean folded into weights
        rows, lens, scale = [], [], []
        for b in range(batch.batch_size):
            for k, f in enumerate(g.features):
                vals, ln = batch[f]
                start = int(ln[:b].sum())
                n = int(ln[b])
                rows += (vals[start : start + n] + int(g.feature_row_offset[k])).tolist()
                lo = int(batch.offsets()[batch.keys.index(f) * batch.batch_size]) + start
                w = batch.weights[lo : lo + n] if batch.weights is not None else torch.ones(n)
                scale += (w * (1.0 / n if f == "f3" and n else 1.0)).tolist()
                lens.append(n)
        offsets = torch.tensor([0] + lens).cumsum(0)
        tu, ts = row_gradients(torch.tensor(rows, dtype=torch.int64), offsets, grad.view(-1, 128),
                               torch.tensor(scale, dtype=torch.float32))  # fmt: skip
        assert torch.equal(u, tu)
        assert torch.equal(s, ts), (s - ts).abs().max()


@pytest.mark.parametrize(("opt_name", "with_msq"), [(o, False) for o in sorted(OPTIMIZERS)] + [("rowwise_adagrad", True)])
def test_apply_rows_equals_the_optimizer_definition(opt_name, with_msq):
    """The native update of already-summed rows (data-parallel replicas, column shards) matches
    ``SparseOptimizer.apply``, including a given whole-row mean square for row-wise Adagrad."""
    gen = torch.Generator().manual_seed(5)
    pair = _pair(TABLES[:1], opt_name)
    mod = native.load()
    rows = torch.tensor([0, 3, 7, 19, 38], dtype=torch.int64)
    for step in (1, 2, 3):
        summed = torch.randn(rows.numel(), 128, generator=gen)
        msq = torch.rand(rows.numel(), generator=gen) if with_msq else None
        nat, ref = pair["native"].groups[0], pair["torch"].groups[0]
        kind, hp = native.optimizer_args(pair["native"].optimizer, step)
        state = nat.storage.state_tensors()
        states = [state[k] for k in pair["native"].optimizer.state_columns(nat.dim)]
        mod.apply_rows(rows, summed, msq, nat.storage.weight, states, kind, hp, None)
        pair["torch"].optimizer.apply(ref.storage, rows, summed, step, msq)
        _assert_same(nat.storage.weight, ref.storage.weight, opt_name in EXACT, f"step {step} weights")
        for k, v in ref.storage.state_tensors().items():
            _assert_same(state[k], v, opt_name in EXACT, f"step {step} state {k}")
    with pytest.raises(ValueError, match="out of the table's range"):
        mod.apply_rows(torch.tensor([10**6]), torch.zeros(1, 128), None, nat.storage.weight, states, kind, hp, None)


@settings(max_examples=40, deadline=None)
@given(n=st.one_of(st.integers(1, 40_000), st.just(300_000)),
       top=st.sampled_from([1, 7, 2047, 2048, 5_000_000, 2**32, 2**32 + 1, 2**40]), seed=st.integers(0, 99))
def test_stable_argsort_equals_torch(n, top, seed):
    # The radix sort that replaces torch's sorts (row routing and column-shard row statistics):
    # the same stable order, for keys of one to four digits, on the parallel path (keys under
    # 2^32, chunks per thread) and the serial one.
    keys = torch.randint(0, top, (n,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(native.load().stable_argsort(keys), torch.argsort(keys, stable=True))
    assert torch.equal(native.stable_argsort(keys), torch.argsort(keys, stable=True))
    with pytest.raises(ValueError, match="non-negative"):
        native.load().stable_argsort(torch.tensor([3, -1]))


def test_empty_bags_and_empty_batch():
    pair = _pair(TABLES, "rowwise_adagrad")
    batch = JaggedBatch.from_lists({f: [[], [1, 1, 2], []] for f in FEATURES})
    _run_steps(pair, [batch], torch.Generator().manual_seed(0), exact=False)
    empty = JaggedBatch.from_lists({f: [] for f in FEATURES})
    out = pair["native"](empty)
    assert out.shape == (0, sum(pair["native"].feature_dims))
    out.sum().backward()


def test_touched_rows_marked_on_both_kernels():
    gen = torch.Generator().manual_seed(5)
    pair = _pair(TABLES, "adam")
    for m in pair.values():
        for g in m.groups:
            g.touched = torch.zeros(g.num_rows, dtype=torch.uint8)
    batch = _random_batch(FEATURES, 4, gen, weighted=False)
    for m in pair.values():
        m(batch).sum().backward()
    for gn, gt in zip(pair["native"].groups, pair["torch"].groups):
        assert torch.equal(gn.touched, gt.touched)
        assert int(gn.touched.sum()) > 0


class _UnmirroredSGD(SGD):
    """SGD under a type the native kernel does not recognise (it mirrors exact types only), so
    its gradients are summed natively and the update runs in Python."""


def test_unmirrored_optimizer_runs_in_python_on_native_gradients():
    tables = TABLES[:2]
    native_m = TableBatchedEmbeddingBags(tables, _UnmirroredSGD(lr=0.1), seed=2, kernel="native")
    torch_m = TableBatchedEmbeddingBags(tables, SGD(lr=0.1), seed=2, kernel="torch")
    batch = _random_batch({"f1": 40, "f2": 40, "f3": 25}, 5, torch.Generator().manual_seed(2), weighted=True)
    for m in (native_m, torch_m):
        m(batch).sum().backward()
    assert torch.equal(native_m.table_weight("a"), torch_m.table_weight("a"))


def test_eval_mode_forward_and_bad_id_error():
    m = TableBatchedEmbeddingBags(TABLES[:2], SGD(lr=0.1), kernel="native")
    batch = JaggedBatch.from_lists({"f1": [[1]], "f2": [[2, 3]], "f3": [[0]]})
    with torch.no_grad():
        a = m(batch)
    assert torch.equal(a, m(batch).detach())
    bad = JaggedBatch.from_lists({"f1": [[1]], "f2": [[2, 40]], "f3": [[0]]})
    with pytest.raises(SparseInputError, match=r"feature 'f2': id 40 is outside its table of 40 rows"):
        m(bad)


def test_int32_ids():
    pair = _pair(TABLES, "sgd")
    batch = _random_batch(FEATURES, 3, torch.Generator().manual_seed(4), weighted=False)
    b32 = JaggedBatch(batch.keys, batch.values.to(torch.int32), batch.lengths)
    assert torch.equal(pair["native"](b32), pair["torch"](batch))


def test_kernel_choice_and_env_override(monkeypatch):
    with pytest.raises(ValueError, match="model.embedding_kernel"):
        TableBatchedEmbeddingBags(TABLES[:1], SGD(), kernel="fast")
    monkeypatch.setenv(native.ENV_VAR, "torch")
    m = TableBatchedEmbeddingBags(TABLES[:1], SGD(), kernel="native")
    assert m.kernel == "torch" and m._native_kernels(m.groups[0]) is None
    monkeypatch.setenv(native.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=native.ENV_VAR):
        TableBatchedEmbeddingBags(TABLES[:1], SGD())


def test_low_precision_storage_stays_on_torch_kernels():
    t = [TableConfig("a", 10, 8, dtype="bf16")]
    m = TableBatchedEmbeddingBags(t, SGD(), kernel="native")
    assert m._native_kernels(m.groups[0]) is None


def test_same_result_on_one_and_two_threads():
    """The summation order never depends on the thread count."""
    gen = torch.Generator().manual_seed(9)
    batch = _random_batch(FEATURES, 64, gen, weighted=True, max_len=20)
    grad = None
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            m = TableBatchedEmbeddingBags(TABLES, RowWiseAdagrad(lr=0.1), seed=1, kernel="native")
            out = m(batch)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)) if grad is None else grad
            out.backward(grad)
            results.append([m.table_weight(t.name).clone() for t in TABLES])
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_embedding_op_benchmark_multi_hot_quick(tmp_path):
    """The benchmark's multi-hot case runs, times native and torch kernels, writes its JSON."""
    import json
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "op.json"
    proc = proc_utils.run(
        [sys.executable, "benchmarks/embedding_op.py", "--config", "multi-hot", "--quick", "--threads", "1",
         "--iters", "2", "--json", str(out)],
        cwd=repo, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (rep,) = json.loads(out.read_text())["configs"]
    assert rep["config"] == "multi-hot" and rep["ids_per_sample"] == 214
    assert {"recscale", "recscale_torch", "plain_pytorch"} <= set(rep["results"])
    assert "native kernels" in rep["results"]["recscale"]["description"]
    assert "torch kernels" in rep["results"]["recscale_torch"]["description"]
