"""The table-batched fused operator equals a plain float64 reference, step after step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.embedding import SGD, Adagrad, Adam, RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.sparse import JaggedBatch, SparseInputError

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.1, eps=1e-8),
    "adagrad": lambda: Adagrad(lr=0.1, eps=1e-8),
    "adam": lambda: Adam(lr=0.05, beta1=0.9, beta2=0.99, eps=1e-8),
}


# ---------------------------------------------------------------------- reference (float64)
class Reference:
    """One weight matrix per table, plain loops over bags, the optimizer math written out."""

    def __init__(self, module: TableBatchedEmbeddingBags, opt_name: str) -> None:
        self.tables = {t.name: t for t in module.tables}
        self.w = {t.name: module.table_weight(t.name).double().clone() for t in module.tables}
        self.table_of = {f: t for t in module.tables for f in t.features}
        self.opt_name = opt_name
        self.opt = module.optimizer
        self.state = {name: self._zeros(t) for name, t in self.tables.items()}
        self.step = 0

    def _zeros(self, t: TableConfig) -> dict[str, torch.Tensor]:
        cols = self.opt.state_columns(t.dim)
        return {k: torch.zeros(t.num_rows, c, dtype=torch.float64) for k, c in cols.items()}

    def bags(self, batch: JaggedBatch, feature: str):
        values, lengths = batch[feature]
        lo = batch.offsets()[batch.keys.index(feature) * batch.batch_size]
        start = 0
        for n in lengths.tolist():
            ids = values[start : start + n].tolist()
            if batch.weights is not None:
                ws = batch.weights[int(lo) + start : int(lo) + start + n].double().tolist()
            else:
                ws = [1.0] * n
            yield ids, ws
            start += n

    def forward(self, batch: JaggedBatch, feature_order) -> torch.Tensor:
        cols = []
        for f in feature_order:
            t = self.table_of[f]
            rows = []
            for ids, ws in self.bags(batch, f):
                v = torch.zeros(t.dim, dtype=torch.float64)
                for i, w in zip(ids, ws):
                    v += w * self.w[t.name][i]
                if t.pooling == "mean" and ids:
                    v /= len(ids)
                rows.append(v)
            cols.append(torch.stack(rows))
        return torch.cat(cols, dim=1)

    def backward_and_update(self, batch: JaggedBatch, feature_order, grad_out: torch.Tensor) -> None:
        self.step += 1
        grads: dict[str, dict[int, torch.Tensor]] = {name: {} for name in self.tables}
        col = 0
        for f in feature_order:
            t = self.table_of[f]
            for b, (ids, ws) in enumerate(self.bags(batch, f)):
                g_bag = grad_out[b, col : col + t.dim]
                scale = 1.0 / len(ids) if (t.pooling == "mean" and ids) else 1.0
                for i, w in zip(ids, ws):
                    acc = grads[t.name].setdefault(i, torch.zeros(t.dim, dtype=torch.float64))
                    acc += scale * w * g_bag
            col += t.dim
        for name, rows in grads.items():
            for r, g in rows.items():
                self._update(name, r, g)

    def _update(self, name: str, r: int, g: torch.Tensor) -> None:
        w, s, o = self.w[name], self.state[name], self.opt
        if self.opt_name == "sgd":
            w[r] -= o.lr * g
        elif self.opt_name == "rowwise_adagrad":
            s["sum_sq"][r, 0] += (g * g).mean()
            w[r] -= o.lr * g / (math.sqrt(s["sum_sq"][r, 0]) + o.eps)
        elif self.opt_name == "adagrad":
            s["sum_sq"][r] += g * g
            w[r] -= o.lr * g / (s["sum_sq"][r].sqrt() + o.eps)
        else:
            m, v = s["exp_avg"], s["exp_avg_sq"]
            m[r] = o.beta1 * m[r] + (1 - o.beta1) * g
            v[r] = o.beta2 * v[r] + (1 - o.beta2) * g * g
            mhat = m[r] / (1 - o.beta1**self.step)
            vhat = v[r] / (1 - o.beta2**self.step)
            w[r] -= o.lr * mhat / (vhat.sqrt() + o.eps)


# ---------------------------------------------------------------------- strategies
@st.composite
def problems(draw):
    num_tables = draw(st.integers(1, 3))
    tables, features = [], []
    for t in range(num_tables):
        shared = draw(st.integers(1, 2))  # features sharing this table
        feats = tuple(f"t{t}f{j}" for j in range(shared))
        tables.append(
            TableConfig(
                name=f"t{t}",
                num_rows=draw(st.integers(1, 12)),
                dim=draw(st.sampled_from([2, 3, 4])),
                features=feats,
                pooling=draw(st.sampled_from(["sum", "mean"])),
            )
        )
        features.extend((f, tables[-1].num_rows) for f in feats)
    batch_size = draw(st.integers(1, 4))
    weighted = draw(st.booleans())
    batches = []
    for _ in range(draw(st.integers(1, 3))):
        ids, wts = {}, {}
        for f, rows in features:
            bags = [draw(st.lists(st.integers(0, rows - 1), min_size=0, max_size=4)) for _ in range(batch_size)]
            ids[f] = bags
            wts[f] = [[draw(st.sampled_from([0.5, 1.0, 1.5, 2.0])) for _ in bag] for bag in bags]
        batches.append(JaggedBatch.from_lists(ids, wts if weighted else None))
    return tables, batches, draw(st.sampled_from(sorted(OPTIMIZERS))), draw(st.integers(0, 2**16))


def _run_and_compare(tables, batches, opt_name, seed):
    module = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt_name](), seed=seed)
    ref = Reference(module, opt_name)
    order = module.feature_names
    gen = torch.Generator().manual_seed(seed)
    for batch in batches:
        out = module(batch)
        expected = ref.forward(batch, order)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
        grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out * grad_out.float()).sum().backward()
        ref.backward_and_update(batch, order, grad_out.float().double())
        for t in tables:
            torch.testing.assert_close(module.table_weight(t.name).double(), ref.w[t.name], rtol=1e-4, atol=1e-5)
            for k, v in module.table_state(t.name).items():
                torch.testing.assert_close(v.double(), ref.state[t.name][k], rtol=1e-4, atol=1e-6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(problems())
def test_equals_reference_over_random_shapes(problem):
    _run_and_compare(*problem)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_equals_reference_every_optimizer_pooling_and_weighting(opt_name, pooling, weighted):
    """Explicit grid: duplicates within a bag, across bags, across features sharing a table,
    empty bags and an all-empty feature, tables of two dims (two storage groups)."""
    tables = [
        TableConfig("shared", 6, 4, features=("a", "b"), pooling=pooling),
        TableConfig("other", 5, 4, features=("c",), pooling=pooling),
        TableConfig("narrow", 3, 2, features=("d",), pooling=pooling),
    ]
    ids = {
        "a": [[1, 1, 2], [], [1]],
        "b": [[2, 1], [5], []],
        "c": [[], [], []],
        "d": [[0, 2, 0], [1], [2, 2]],
    }
    wts = {k: [[0.5 + 0.25 * j for j in range(len(bag))] for bag in bags] for k, bags in ids.items()}
    batch = JaggedBatch.from_lists(ids, wts if weighted else None)
    _run_and_compare(tables, [batch, batch], opt_name, seed=3)


def _train(seed: int, steps: int = 5):
    tables = [TableConfig("x", 50, 8, features=("f", "g")), TableConfig("y", 30, 8, pooling="mean")]
    module = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.05), seed=seed)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        vals = torch.randint(0, 30, (40,), generator=gen)
        lens = torch.tensor([4] * 10 + [3, 5] * 5 + [2] * 5 + [0] * 5)
        batch = JaggedBatch(("f", "g", "y"), vals[: int(lens.sum())] if lens.sum() <= 40 else vals, lens)
        batch = JaggedBatch(("f", "g", "y"), torch.randint(0, 30, (int(lens.sum()),), generator=gen), lens)
        out = module(batch)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return module


def test_two_runs_are_bitwise_identical():
    a, b = _train(seed=7), _train(seed=7)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    c = _train(seed=8)
    assert not torch.equal(a.table_weight("x"), c.table_weight("x"))


def test_no_parameter_or_gradient_of_table_size():
    module = _train(seed=0, steps=2)
    assert sum(p.numel() for p in module.parameters()) == 0
    anchor = module._grad_anchor
    assert anchor.grad is None or anchor.grad.numel() == 0


def test_eval_without_grad_matches_and_does_not_update():
    module = _train(seed=0, steps=1)
    batch = JaggedBatch.from_lists({"f": [[1, 2]], "g": [[3]], "y": [[4, 4]]})
    before = module.table_weight("x").clone()
    with torch.no_grad():
        a = module(batch)
    b = module(batch).detach()
    assert torch.equal(a, b)
    assert torch.equal(before, module.table_weight("x"))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_reduced_precision_storage_trains_close_to_fp32(dtype):
    def run(dt):
        tables = [TableConfig("t", 20, 8, features=("f",), dtype=dt, init_range=(-0.1, 0.1))]
        m = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.05), seed=0)
        gen = torch.Generator().manual_seed(0)
        for _ in range(5):
            batch = JaggedBatch(("f",), torch.randint(0, 20, (12,), generator=gen), torch.full((4,), 3))
            out = m(batch)
            (out * torch.randn(out.shape, generator=gen)).sum().backward()
        return m.table_weight("t").float()

    low, full = run(dtype), run("fp32")
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, full, rtol=0, atol=2e-2)


def test_validate_names_feature_and_table_size():
    m = TableBatchedEmbeddingBags([TableConfig("t", 10, 4, features=("f",))], SGD(lr=0.1))
    with pytest.raises(SparseInputError, match=r"feature 'f': id 10 is outside its table of 10 rows"):
        m.validate(JaggedBatch.from_lists({"f": [[1], [10]]}))
    with pytest.raises(SparseInputError, match=r"feature 'f': id -1"):
        m.validate(JaggedBatch.from_lists({"f": [[-1]]}))
    with pytest.raises(SparseInputError, match=r"lacks features \['f'\]"):
        m.validate(JaggedBatch.from_lists({"g": [[1]]}))


def test_bad_table_configs_are_clear():
    with pytest.raises(ValueError, match="feature 'f' is served by tables 'a' and 'b'"):
        TableBatchedEmbeddingBags([TableConfig("a", 3, 2, ("f",)), TableConfig("b", 3, 2, ("f",))], SGD())
    with pytest.raises(ValueError, match="num_rows must be > 0"):
        TableConfig("a", 0, 2)
    with pytest.raises(ValueError, match="pooling must be 'sum' or 'mean'"):
        TableConfig("a", 3, 2, pooling="max")  # type: ignore[arg-type]
