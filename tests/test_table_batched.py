"""The table-batched fused operator (TableBatchedEmbeddingBags) against an independent float64
plain-PyTorch reference, step after step, and its contract (determinism, no table-sized
gradients, clear errors).

The reference keeps one float64 weight per table (copied from the operator's initial rows),
pools every feature with ``F.embedding_bag``, gets dense per-table gradients from autograd and
applies the optimizer math written out below to the rows whose ids appear in the batch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recscale.embedding import SGD, Adagrad, Adam, RowWiseAdagrad, TableBatchedEmbeddingBags, TableConfig
from recscale.sparse import JaggedBatch, SparseInputError

LR = 0.05
EPS = 1e-8
BETA1, BETA2 = 0.9, 0.999
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=LR),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=LR, eps=EPS),
    "adagrad": lambda: Adagrad(lr=LR, eps=EPS),
    "adam": lambda: Adam(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS),
}
RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------------------- reference
class Reference:
    """Plain float64 per-table embedding bags with the optimizer written out."""

    def __init__(self, module: TableBatchedEmbeddingBags, tables: list[TableConfig], opt: str) -> None:
        self.tables = {t.name: t for t in tables}
        self.table_of = {f: t.name for t in tables for f in t.features}
        self.opt = opt
        self.step = 0
        self.w = {t.name: module.table_weight(t.name).detach().double().clone() for t in tables}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for t in tables:
            z = torch.zeros(t.num_rows, t.dim, dtype=torch.float64)
            if opt == "rowwise_adagrad":
                self.state[t.name] = {"sum_sq": torch.zeros(t.num_rows, 1, dtype=torch.float64)}
            elif opt == "adagrad":
                self.state[t.name] = {"sum_sq": z.clone()}
            elif opt == "adam":
                self.state[t.name] = {"exp_avg": z.clone(), "exp_avg_sq": z.clone()}
            else:
                self.state[t.name] = {}

    def _pool(self, params: dict[str, torch.Tensor], batch: JaggedBatch, feature: str) -> torch.Tensor:
        t = self.tables[self.table_of[feature]]
        ids, lengths = batch[feature]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        lo = int(batch.offsets()[batch.keys.index(feature) * batch.batch_size])
        w = None
        if batch.weights is not None:
            w = batch.weights[lo : lo + ids.numel()].double()
        if t.pooling == "mean" and w is None:
            return F.embedding_bag(ids, params[t.name], offsets, mode="mean", include_last_offset=True)
        if t.pooling == "mean":
            # Weighted mean: sum of weight x row, divided by the bag's id count.
            w = w / torch.repeat_interleave(lengths.clamp(min=1).double(), lengths)
        return F.embedding_bag(ids, params[t.name], offsets, mode="sum", per_sample_weights=w,
                               include_last_offset=True)

    def forward(self, batch: JaggedBatch, order: tuple[str, ...], params=None) -> torch.Tensor:
        params = self.w if params is None else params
        return torch.cat([self._pool(params, batch, f) for f in order], dim=1)

    def train_step(self, batch: JaggedBatch, order: tuple[str, ...], upstream: torch.Tensor) -> torch.Tensor:
        params = {k: v.clone().requires_grad_(True) for k, v in self.w.items()}
        out = self.forward(batch, order, params)
        loss = (out * upstream.double()).sum()
        names = list(params)
        grads = dict(zip(names, torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)))
        self.step += 1
        for name in names:
            feats = [f for f in self.tables[name].features if f in batch.keys]
            ids = torch.cat([batch[f][0] for f in feats]) if feats else torch.zeros(0, dtype=torch.int64)
            rows = torch.unique(ids)
            if rows.numel() == 0:
                continue
            g_full = grads[name] if grads[name] is not None else torch.zeros_like(self.w[name])
            self._update(name, rows, g_full[rows])
        return out.detach()

    def _update(self, name: str, rows: torch.Tensor, g: torch.Tensor) -> None:
        w, s, t = self.w[name], self.state[name], self.step
        if self.opt == "sgd":
            w[rows] -= LR * g
        elif self.opt == "rowwise_adagrad":
            s["sum_sq"][rows] += (g * g).mean(dim=1, keepdim=True)
            w[rows] -= LR * g / (s["sum_sq"][rows].sqrt() + EPS)
        elif self.opt == "adagrad":
            s["sum_sq"][rows] += g * g
            w[rows] -= LR * g / (s["sum_sq"][rows].sqrt() + EPS)
        elif self.opt == "adam":
            m = BETA1 * s["exp_avg"][rows] + (1 - BETA1) * g
            v = BETA2 * s["exp_avg_sq"][rows] + (1 - BETA2) * g * g
            s["exp_avg"][rows], s["exp_avg_sq"][rows] = m, v
            bc1, bc2 = 1 - BETA1**t, 1 - BETA2**t
            w[rows] -= LR * (m / bc1) / ((v / bc2).sqrt() + EPS)
        else:  # pragma: no cover
            raise AssertionError(self.opt)


def assert_matches(module: TableBatchedEmbeddingBags, ref: Reference, where: str) -> None:
    for name in ref.tables:
        got = module.table_weight(name).double()
        torch.testing.assert_close(got, ref.w[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} {name}: {m}")
        got_state = module.table_state(name)
        assert set(got_state) == set(ref.state[name]), (where, name, set(got_state))
        for k, v in ref.state[name].items():
            torch.testing.assert_close(got_state[k].double(), v, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{where} {name}.{k}: {m}")


# ---------------------------------------------------------------------------- strategies
@st.composite
def scenarios(draw):
    n_tables = draw(st.integers(1, 3))
    tables = []
    fid = 0
    for i in range(n_tables):
        n_feat = draw(st.integers(1, 2))
        feats = tuple(f"f{fid + j}" for j in range(n_feat))
        fid += n_feat
        tables.append(TableConfig(
            name=f"t{i}",
            num_rows=draw(st.integers(1, 12)),
            dim=draw(st.sampled_from([2, 3, 4, 5])),
            features=feats,
            pooling=draw(st.sampled_from(["sum", "mean"])),
        ))
    opt = draw(st.sampled_from(sorted(OPTIMIZERS)))
    weighted = draw(st.booleans())
    b = draw(st.integers(1, 4))
    rows_of = {f: t.num_rows for t in tables for f in t.features}
    all_feats = list(rows_of)
    batches = []
    for _ in range(3):
        key_order = draw(st.permutations(all_feats))
        empty_feature = draw(st.sampled_from([None, *all_feats]))
        feats, wts = {}, {}
        for f in key_order:
            max_len = 0 if f == empty_feature else 3
            bags = [draw(st.lists(st.integers(0, rows_of[f] - 1), max_size=max_len)) for _ in range(b)]
            feats[f] = bags
            wts[f] = [[draw(st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0])) for _ in bag] for bag in bags]
        batches.append(JaggedBatch.from_lists(feats, wts if weighted else None))
    seed = draw(st.integers(0, 2**16))
    return tables, opt, batches, seed


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_matches_float64_reference(scenario):
    tables, opt, batches, seed = scenario
    module = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=seed)
    ref = Reference(module, tables, opt)
    order = module.feature_names
    assert sorted(order) == sorted(f for t in tables for f in t.features)
    gen = torch.Generator().manual_seed(seed)
    for step, batch in enumerate(batches):
        module.validate(batch)
        out = module(batch)
        upstream = torch.randn(out.shape, generator=gen)
        expected = ref.train_step(batch, order, upstream)
        assert out.dtype == torch.float32
        assert out.shape == (batch.batch_size, sum(t.dim * len(t.features) for t in tables))
        torch.testing.assert_close(out.detach().double(), expected, rtol=RTOL, atol=ATOL)
        (out * upstream).sum().backward()
        assert_matches(module, ref, f"{opt} step {step}")


# ---------------------------------------------------------------------------- targeted cases
def _shared_tables(pooling="sum", dtype="fp32"):
    return [
        TableConfig("a", num_rows=7, dim=4, features=("f1", "f2"), pooling=pooling, dtype=dtype),
        TableConfig("b", num_rows=5, dim=4, features=("f3",), pooling="mean", dtype=dtype),
        TableConfig("c", num_rows=9, dim=3, features=("f4",), dtype=dtype),
    ]


def _batches(n, weighted=False, seed=0, b=4):
    gen = torch.Generator().manual_seed(seed)
    rows = {"f1": 7, "f2": 7, "f3": 5, "f4": 9}
    out = []
    for _ in range(n):
        feats, wts = {}, {}
        for f, r in rows.items():
            bags = []
            for _ in range(b):
                k = int(torch.randint(0, 4, (1,), generator=gen))
                bags.append(torch.randint(0, r, (k,), generator=gen).tolist())
            feats[f] = bags
            wts[f] = [(torch.rand(len(bag), generator=gen) + 0.5).tolist() for bag in bags]
        out.append(JaggedBatch.from_lists(feats, wts if weighted else None))
    return out


def _train(module, batches, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for batch in batches:
        out = module(batch)
        (out * torch.randn(out.shape, generator=gen)).sum().backward()


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_explicit_duplicates_and_empty_bags(opt, pooling, weighted):
    """Duplicates in a bag, across bags, across two features of one table; empty bags; an
    all-empty feature; tables of two dims (two storage groups)."""
    tables = _shared_tables(pooling=pooling)
    feats = {
        "f1": [[1, 1, 2], [], [1], [6, 6]],
        "f2": [[1], [2, 2, 2], [], [0]],
        "f3": [[], [], [], []],  # an all-empty feature
        "f4": [[8], [8, 8], [0, 8], []],
    }
    wts = {f: [[0.5 + 0.25 * (i % 5) for i, _ in enumerate(bag)] for bag in bags] for f, bags in feats.items()}
    batch = JaggedBatch.from_lists(feats, wts if weighted else None)
    module = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=3)
    ref = Reference(module, tables, opt)
    before_b = module.table_weight("b").clone()
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        out = module(batch)
        upstream = torch.randn(out.shape, generator=gen)
        expected = ref.train_step(batch, module.feature_names, upstream)
        torch.testing.assert_close(out.detach().double(), expected, rtol=RTOL, atol=ATOL)
        (out * upstream).sum().backward()
        assert_matches(module, ref, f"step {step}")
    # Table b only saw empty bags: untouched, state still zero.
    assert torch.equal(module.table_weight("b"), before_b)
    for v in module.table_state("b").values():
        assert not v.any()
    # Untouched rows of table a keep their initial value.
    assert torch.equal(module.table_weight("a")[3:6].double(), ref.w["a"][3:6])


def test_all_empty_batch_trains_nothing():
    tables = _shared_tables()
    module = TableBatchedEmbeddingBags(tables, RowWiseAdagrad(lr=0.1), seed=0)
    before = {t.name: module.table_weight(t.name).clone() for t in tables}
    batch = JaggedBatch.from_lists({f: [[], []] for f in ("f1", "f2", "f3", "f4")})
    out = module(batch)
    assert out.shape == (2, 4 * 3 + 3)
    assert not out.any()
    out.sum().backward()
    for t in tables:
        assert torch.equal(module.table_weight(t.name), before[t.name])
        assert not module.table_state(t.name)["sum_sq"].any()


def test_no_table_sized_gradient_or_parameter():
    tables = _shared_tables()
    module = TableBatchedEmbeddingBags(tables, Adam(lr=0.01), seed=0)
    assert sum(p.numel() for p in module.parameters()) == 0
    for t in tables:
        assert not module.table_weight(t.name).requires_grad
    _train(module, _batches(2))
    anchor = module._grad_anchor
    assert anchor.grad is None or anchor.grad.numel() == 0
    assert sum(p.numel() for p in module.parameters()) == 0
    for p in module.parameters():
        assert p.grad is None or p.grad.numel() == 0
    for t in tables:
        assert module.table_weight(t.name).grad is None


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_two_runs_are_bitwise_identical(opt):
    batches = _batches(5, weighted=True, seed=7)

    def run():
        m = TableBatchedEmbeddingBags(_shared_tables(pooling="mean"), OPTIMIZERS[opt](), seed=11)
        _train(m, batches, seed=5)
        return m

    a, b = run(), run()
    for t in _shared_tables():
        assert torch.equal(a.table_weight(t.name), b.table_weight(t.name))
        sa, sb = a.table_state(t.name), b.table_state(t.name)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k])
    # and training really changed something
    fresh = TableBatchedEmbeddingBags(_shared_tables(pooling="mean"), OPTIMIZERS[opt](), seed=11)
    assert not torch.equal(fresh.table_weight("a"), a.table_weight("a"))


def test_same_seed_same_init_different_seed_differs():
    a = TableBatchedEmbeddingBags(_shared_tables(), SGD(lr=0.1), seed=1)
    b = TableBatchedEmbeddingBags(_shared_tables(), SGD(lr=0.1), seed=1)
    c = TableBatchedEmbeddingBags(_shared_tables(), SGD(lr=0.1), seed=2)
    assert torch.equal(a.table_weight("a"), b.table_weight("a"))
    assert not torch.equal(a.table_weight("a"), c.table_weight("a"))
    lo, hi = -1 / math.sqrt(7), 1 / math.sqrt(7)
    w = a.table_weight("a")
    assert float(w.min()) >= lo and float(w.max()) <= hi


@pytest.mark.parametrize("dtype,atol", [("fp16", 5e-3), ("bf16", 3e-2)])
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam"])
def test_low_precision_storage_tracks_fp32(dtype, atol, opt):
    batches = _batches(5, weighted=True, seed=3)
    ref = TableBatchedEmbeddingBags(_shared_tables(), OPTIMIZERS[opt](), seed=4)
    low = TableBatchedEmbeddingBags(_shared_tables(dtype=dtype), OPTIMIZERS[opt](), seed=4)
    want = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    start = low.table_weight("a").clone()
    _train(ref, batches, seed=9)
    _train(low, batches, seed=9)
    for t in _shared_tables():
        w = low.table_weight(t.name)
        assert w.dtype == want
        assert torch.isfinite(w.float()).all()
        torch.testing.assert_close(w.float(), ref.table_weight(t.name), rtol=0, atol=atol)
    assert not torch.equal(start, low.table_weight("a"))
    out = low(batches[0])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_no_grad_eval_matches_and_does_not_update():
    tables = _shared_tables(pooling="mean")
    module = TableBatchedEmbeddingBags(tables, Adagrad(lr=0.1), seed=0)
    _train(module, _batches(2, weighted=True))
    batch = _batches(1, weighted=True, seed=42)[0]
    before = {t.name: module.table_weight(t.name).clone() for t in tables}
    state_before = {t.name: {k: v.clone() for k, v in module.table_state(t.name).items()} for t in tables}
    with_grad = module(batch)
    assert with_grad.requires_grad
    with torch.no_grad():
        no_grad = module(batch)
    assert not no_grad.requires_grad
    assert torch.equal(with_grad.detach(), no_grad)
    with torch.inference_mode():
        assert torch.equal(module(batch), no_grad)
    for t in tables:
        assert torch.equal(module.table_weight(t.name), before[t.name])
        for k, v in module.table_state(t.name).items():
            assert torch.equal(v, state_before[t.name][k])


def test_output_columns_follow_feature_names():
    tables = _shared_tables()
    module = TableBatchedEmbeddingBags(tables, SGD(lr=0.1), seed=0)
    assert module.feature_names == ("f1", "f2", "f3", "f4")
    assert module.feature_dims == (4, 4, 4, 3)
    batch = JaggedBatch.from_lists({"f4": [[2]], "f3": [[4]], "f2": [[0]], "f1": [[6]]})
    out = module(batch)
    with torch.no_grad():
        expect = torch.cat([module.table_weight("a")[6], module.table_weight("a")[0],
                            module.table_weight("b")[4], module.table_weight("c")[2]])
    assert torch.equal(out[0].detach(), expect)


def test_validate_names_the_feature():
    module = TableBatchedEmbeddingBags(_shared_tables(), SGD(lr=0.1), seed=0)
    good = {"f1": [[0], [6]], "f2": [[1], []], "f3": [[4], [0]], "f4": [[8], [0]]}
    module.validate(JaggedBatch.from_lists(good))
    too_big = dict(good, f3=[[5], [0]])
    with pytest.raises(SparseInputError, match=r"feature 'f3'.*id 5.*5 rows"):
        module.validate(JaggedBatch.from_lists(too_big))
    negative = dict(good, f2=[[-1], []])
    with pytest.raises(SparseInputError, match=r"feature 'f2'.*id -1"):
        module.validate(JaggedBatch.from_lists(negative))
    missing = {k: v for k, v in good.items() if k != "f4"}
    with pytest.raises(SparseInputError, match=r"lacks features \['f4'\]"):
        module.validate(JaggedBatch.from_lists(missing))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_touched_row_with_zero_gradient(opt):
    """A row whose ids appear but whose summed gradient is exactly zero still counts as touched:
    Adam decays its moments (and moves it by the decayed momentum); the others leave it be."""
    tables = [TableConfig("t", num_rows=4, dim=3, features=("f1", "f2"))]
    module = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=0)
    ref = Reference(module, tables, opt)
    order = module.feature_names
    warm = JaggedBatch.from_lists({"f1": [[2], [1]], "f2": [[2, 3], []]})
    out = module(warm)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    ref.train_step(warm, order, up)
    (out * up).sum().backward()
    # Row 2 appears only in the bag of sample 0 of f1, whose upstream gradient is zero.
    batch = JaggedBatch.from_lists({"f1": [[2], [1]], "f2": [[], [3]]})
    out = module(batch)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    up[0, :3] = 0.0
    before = module.table_weight("t")[2].clone()
    ref.train_step(batch, order, up)
    (out * up).sum().backward()
    assert_matches(module, ref, opt)
    if opt == "adam":
        assert not torch.equal(module.table_weight("t")[2], before)
        torch.testing.assert_close(module.table_state("t")["exp_avg"][2].double(),
                                   ref.state["t"]["exp_avg"][2], rtol=RTOL, atol=1e-9)
    else:
        assert torch.equal(module.table_weight("t")[2], before)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("weighted", [False, True])
def test_one_id_per_bag_fast_paths(opt, weighted):
    """One id per (feature, sample) bag (the Criteo case) takes transpose shortcuts in forward and
    backward; they must agree with the reference, repeated rows across samples included."""
    tables = _shared_tables(pooling="mean")
    ids = torch.tensor([[1, 1, 4, 8], [1, 6, 0, 8], [3, 1, 4, 0], [1, 2, 2, 8], [0, 0, 0, 0]])
    batch = JaggedBatch.from_dense_ids(["f1", "f2", "f3", "f4"], ids)
    if weighted:
        w = torch.linspace(0.5, 2.0, batch.values.numel())
        batch = JaggedBatch(batch.keys, batch.values, batch.lengths, w)
    module = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=2)
    ref = Reference(module, tables, opt)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        out = module(batch)
        upstream = torch.randn(out.shape, generator=gen)
        expected = ref.train_step(batch, module.feature_names, upstream)
        torch.testing.assert_close(out.detach().double(), expected, rtol=RTOL, atol=ATOL)
        (out * upstream).sum().backward()
        assert_matches(module, ref, f"step {step}")


def test_bad_table_configs_are_clear():
    with pytest.raises(ValueError, match="feature 'f' is served by tables 'a' and 'b'"):
        TableBatchedEmbeddingBags([TableConfig("a", 3, 2, ("f",)), TableConfig("b", 3, 2, ("f",))], SGD())
    with pytest.raises(ValueError, match="num_rows must be > 0"):
        TableConfig("a", 0, 2)
    with pytest.raises(ValueError, match="pooling must be 'sum' or 'mean'"):
        TableConfig("a", 3, 2, pooling="max")  # type: ignore[arg-type]
