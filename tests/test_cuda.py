"""The CUDA code paths against the CPU run of the same thing.

Every test takes a ``device``: ``cpu`` runs here (the comparison logic itself is exercised, and
the CPU side runs the native kernels where they apply, the other side the same thing again or the
torch kernels), ``cuda`` runs where a CUDA device is present and is skipped elsewhere.

Tolerances, and why they are not zero on CUDA:
- index and integer work (sorting ids, unique rows, bag permutations, wire bytes of fp32/fp16/
  bf16, host copies) must be bitwise equal: CUDA and the CPU compute the same integers and
  round-to-nearest conversions;
- fp32 arithmetic is compared at 1e-5 relative: CUDA sums a bag's rows, a unique row's gradients
  and a GEMM's products in another order than the CPU kernels (and than oneDNN), so results
  differ in the last bits; TF32 is switched off so a CUDA matmul is a true fp32 one;
- fp16/bf16 rows are compared at a few units in the last place of their dtype: an fp32 update
  that differs in its last bit may round to the neighbouring fp16/bf16 value.
"""

from __future__ import annotations

import copy
import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ckpt_utils import run_training
from recscale.checkpoint.snapshot import SnapshotBuffers
from recscale.comm.codecs import get_codec
from recscale.embedding import TableBatchedEmbeddingBags, TableConfig
from recscale.embedding.native import stable_argsort
from recscale.embedding.table_batched import _to_sample_major, row_gradients
from recscale.model import DLRM, LowRankCrossNet
from recscale.model.bf16_linear import bf16_linear
from recscale.sparse import JaggedBatch
from test_table_batched import OPTIMIZERS, _batches, _shared_tables

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# Output atol: a bag sums up to 3 rows of magnitude < 1, so a few ulps at 1; weight atol: a few
# ulps at the rows' magnitude (< 0.5) over 4 steps (each step may round the other way once).
LOW_OUT_ATOL = {"fp16": 4e-3, "bf16": 3e-2}
LOW_W_ATOL = {"fp16": 1e-3, "bf16": 8e-3}


@pytest.fixture(autouse=True)
def _true_fp32_matmuls():
    """CUDA matmuls in full fp32 (no TF32), restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


# ---------------------------------------------------------------------------- sparse inputs
@pytest.mark.parametrize("device", DEVICES)
def test_jagged_batch_to_device_and_index_work_are_exact(device):
    batch = _batches(1, weighted=True, seed=4)[0]
    moved = batch.to(device)
    assert moved.values.device.type == moved.lengths.device.type == moved.weights.device.type == device
    back = moved.to("cpu")
    assert torch.equal(back.values, batch.values) and torch.equal(back.lengths, batch.lengths)
    assert torch.equal(back.weights, batch.weights)
    assert torch.equal(moved.offsets().cpu(), batch.offsets())
    sel, sel_cpu = moved.select(("f4", "f1")), batch.select(("f4", "f1"))
    assert torch.equal(sel.values.cpu(), sel_cpu.values) and torch.equal(sel.weights.cpu(), sel_cpu.weights)
    for part, part_cpu in zip(moved.split([1, 3]), batch.split([1, 3])):
        assert torch.equal(part.values.cpu(), part_cpu.values) and torch.equal(part.lengths.cpu(), part_cpu.lengths)
    # The fused backward's integer work: a stable sort, unique rows, sample-major bag order.
    ids = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(stable_argsort(ids.to(device)).cpu(), stable_argsort(ids))
    lengths = batch.lengths
    k, b = batch.num_keys, batch.batch_size
    got = _to_sample_major(moved.values, moved.lengths, moved.weights, k, b)
    want = _to_sample_major(batch.values, lengths, batch.weights, k, b)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
def test_row_gradients_match_cpu(device, weighted):
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(0, 4, (40,), generator=gen)
    slots = torch.randint(0, 9, (int(lengths.sum()),), generator=gen)  # many duplicates
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    grad = torch.randn(40, 6, generator=gen)
    w = torch.rand(slots.numel(), generator=gen) + 0.5 if weighted else None
    unique, summed = row_gradients(slots.to(device), offsets.to(device), grad.to(device),
                                   None if w is None else w.to(device))
    unique_cpu, summed_cpu = row_gradients(slots, offsets, grad, w)
    assert unique.device.type == summed.device.type == device
    assert torch.equal(unique.cpu(), unique_cpu)
    torch.testing.assert_close(summed.cpu(), summed_cpu, rtol=FP32_RTOL, atol=FP32_ATOL)


# ---------------------------------------------------------------------------- table-batched operator
def _train_steps(module: TableBatchedEmbeddingBags, batches: list[JaggedBatch], device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    outs = []
    for batch in batches:
        out = module(batch.to(device))
        upstream = torch.randn(out.shape, generator=gen)
        (out * upstream.to(device)).sum().backward()
        outs.append(out.detach().cpu())
    return outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_table_batched_fused_update_matches_cpu(device, dtype, pooling, opt):
    """Forward, fused backward and update of every optimizer, on ``device`` (the torch kernels on
    CUDA; on the CPU the native ones where they apply) against the CPU torch kernels."""
    if device == "cpu" and dtype != "fp32":
        pytest.skip("fp16/bf16 rows run the torch kernels on the CPU: the reference itself")
    batches = _batches(4, weighted=True, seed=6)
    tables = _shared_tables(pooling=pooling, dtype=dtype)
    ref = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=3, kernel="torch")
    mod = TableBatchedEmbeddingBags(tables, OPTIMIZERS[opt](), seed=3, device=device)
    if device == "cuda":
        assert not mod.runs_native()
    assert mod.table_weight("a").device.type == device
    want_outs = _train_steps(ref, batches, "cpu")
    got_outs = _train_steps(mod, batches, device)
    out_atol = FP32_ATOL if dtype == "fp32" else LOW_OUT_ATOL[dtype]
    w_rtol, w_atol = (FP32_RTOL, FP32_ATOL) if dtype == "fp32" else (0.0, LOW_W_ATOL[dtype])
    for step, (g, w) in enumerate(zip(got_outs, want_outs)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=FP32_RTOL, atol=out_atol, msg=lambda m: f"step {step} output: {m}")
    for t in tables:
        got_w = mod.table_weight(t.name)
        assert got_w.dtype == ref.table_weight(t.name).dtype
        torch.testing.assert_close(got_w.cpu().float(), ref.table_weight(t.name).float(), rtol=w_rtol, atol=w_atol,
                                   msg=lambda m: f"table {t.name}: {m}")
        got_s, want_s = mod.table_state(t.name), ref.table_state(t.name)
        assert got_s.keys() == want_s.keys()
        for k in want_s:
            # State is fp32 and depends only on the gradients, which do not depend on the rows.
            torch.testing.assert_close(got_s[k].cpu(), want_s[k], rtol=FP32_RTOL, atol=FP32_ATOL,
                                       msg=lambda m: f"table {t.name} state {k}: {m}")
    # Evaluation (no grad) pools the same way and updates nothing.
    with torch.no_grad():
        torch.testing.assert_close(mod(batches[0].to(device)).cpu(), ref(batches[0]), rtol=FP32_RTOL, atol=out_atol)


@pytest.mark.parametrize("device", DEVICES)
def test_module_moved_to_device_after_build_trains_like_one_built_there(device):
    """``model.to(device)`` moves the rows, the optimizer state and the index tensors."""
    batches = _batches(3, weighted=True, seed=8)
    built = TableBatchedEmbeddingBags(_shared_tables(pooling="mean"), OPTIMIZERS["adam"](), seed=5, device=device)
    moved = TableBatchedEmbeddingBags(_shared_tables(pooling="mean"), OPTIMIZERS["adam"](), seed=5).to(device)
    assert moved.device.type == device
    for g, w in zip(_train_steps(moved, batches, device), _train_steps(built, batches, device)):
        assert torch.equal(g, w)
    for t in _shared_tables():
        assert torch.equal(moved.table_weight(t.name).cpu(), built.table_weight(t.name).cpu())


# ---------------------------------------------------------------------------- models
def _tables(dim: int) -> list[TableConfig]:
    return [TableConfig("a", 30, dim, ("f1",)), TableConfig("b", 20, dim, ("f2", "f3"), pooling="mean")]


def _sparse(batch_size: int, seed: int) -> JaggedBatch:
    gen = torch.Generator().manual_seed(seed)
    rows = {"f1": 30, "f2": 20, "f3": 20}
    feats = {f: [torch.randint(0, r, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(batch_size)] for f, r in rows.items()}
    return JaggedBatch.from_lists(feats)


def _dlrm(interaction: str, precision: str, device: str) -> DLRM:
    torch.manual_seed(0)  # the same dense initial weights on every device
    emb = TableBatchedEmbeddingBags(_tables(8), OPTIMIZERS["rowwise_adagrad"](), seed=2, device=device)
    model = DLRM(emb, 5, [16, 8], [16, 1], precision, interaction, dcn_layers=2, dcn_low_rank=4)
    return model.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interaction", ["dot", "dcn"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dlrm_forward_backward_matches_cpu(device, interaction, precision):
    """Two training steps (dense gradients by autograd, rows by the fused update) of DLRM and
    DCNv2 on ``device`` against the CPU. bf16 MLPs: cuBLAS and oneDNN (or the emulated CPU GEMM)
    round bf16 products differently, so 2e-2 relative; fp32: 1e-5 relative."""
    tol = 1e-5 if precision == "fp32" else 2e-2
    ref, mod = _dlrm(interaction, precision, "cpu"), _dlrm(interaction, precision, device)
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        dense = torch.randn(16, 5, generator=gen)
        labels = (torch.rand(16, generator=gen) < 0.3).float()
        sparse = _sparse(16, seed=step)
        grads = []
        for model, dev in ((ref, "cpu"), (mod, device)):
            logits = model(dense.to(dev), sparse.to(dev))
            assert logits.dtype == torch.float32 and logits.device.type == dev
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(dev))
            for p in model.dense_parameters():
                p.grad = None
            loss.backward()
            grads.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()
                                             if not n.startswith("embeddings.")}))
        (want_logits, want_g), (got_logits, got_g) = grads
        assert rel_err(got_logits, want_logits) <= tol, (step, rel_err(got_logits, want_logits))
        assert got_g.keys() == want_g.keys()
        for name in want_g:
            assert got_g[name] is not None and got_g[name].device.type == device, name
            assert rel_err(got_g[name], want_g[name]) <= tol, (step, name, rel_err(got_g[name], want_g[name]))
    for t in _tables(8):
        err = rel_err(mod.embeddings.table_weight(t.name), ref.embeddings.table_weight(t.name))
        assert err <= tol, (t.name, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_cross_layers_match_autograd_on_device(device, dtype):
    """``_CrossLayers`` (hand-written backward) against the same layers through autograd, both on
    ``device``, and the fused forward against the CPU's."""
    gen = torch.Generator().manual_seed(7)
    net = LowRankCrossNet(24, 3, 5)
    with torch.no_grad():  # non-zero biases, so their gradient path is exercised
        for b in net.biases:
            b.copy_(torch.randn(b.shape, generator=gen))
    x0 = torch.randn(10, 24, generator=gen)
    grad = torch.randn(10, 24, generator=gen)
    if dtype == torch.float64:
        net = net.double()
    cpu_net, net = net, copy.deepcopy(net).to(device)
    x_dev = x0.to(device=device, dtype=dtype).requires_grad_()
    x_ref = x0.to(device=device, dtype=dtype).requires_grad_()
    out = net(x_dev)
    ref = net.forward_autograd(x_ref)
    assert out.dtype == dtype and out.device.type == device
    params = list(net.parameters())
    got = torch.autograd.grad(out, [x_dev, *params], grad.to(device=device, dtype=dtype))
    want = torch.autograd.grad(ref, [x_ref, *params], grad.to(device=device, dtype=dtype))
    # bf16: the fused backward rounds its sums at other points than autograd's (same formula).
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    assert rel_err(out, ref) <= tol
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.device.type == device
        assert rel_err(g, w) <= tol, (i, rel_err(g, w))
    cpu_out = cpu_net(x0.to(dtype))
    assert rel_err(out, cpu_out) <= max(tol, 1e-5 if dtype != torch.bfloat16 else 3e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_linear_matches_cpu(device):
    gen = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(12, 20, generator=gen), torch.randn(7, 20, generator=gen), torch.randn(7, generator=gen)
    outs = []
    for dev in ("cpu", device):
        xs, ws, bs = (t.to(dev, copy=True).requires_grad_() for t in (x, w, b))
        y = bf16_linear(xs, ws, bs)
        assert y.dtype == torch.bfloat16 and y.device.type == dev
        y.float().square().sum().backward()
        assert xs.grad.dtype == ws.grad.dtype == bs.grad.dtype == torch.float32
        outs.append((y, xs.grad, ws.grad, bs.grad))
    for got, want in zip(outs[1], outs[0]):
        assert rel_err(got, want) <= 2e-2


# ---------------------------------------------------------------------------- training loop
# 4 training steps of 256 samples, 512 eval samples (the CPU side must stay quick).
SMALL = ["data.num_samples=1024", "data.eval_samples=512"]


def _summary_close(got: dict, want: dict) -> None:
    assert got["steps"] == want["steps"] and got["samples"] == want["samples"]
    # fp32 throughout; the runs differ only in summation order (last bits per step, 4 steps).
    # AUC ranks 512 predictions: a last-bit change can only swap near-ties, each worth ~2e-5.
    assert abs(got["eval_auc"] - want["eval_auc"]) <= 1e-3, (got["eval_auc"], want["eval_auc"])
    assert abs(got["eval_logloss"] - want["eval_logloss"]) <= 1e-4 * want["eval_logloss"]
    assert abs(got["train_logloss"] - want["train_logloss"]) <= 1e-4 * want["train_logloss"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("extra", [[], ["model.interaction=dcn", "model.dcn_low_rank=8",
                                          "embedding_optimizer.name=adam"]])
def test_train_loop_on_device_matches_cpu(device, extra):
    """``train.device`` = cuda against cpu on a tiny synthetic job."""
    want, want_state, _ = run_training(["train.device=cpu", *SMALL, *extra])
    got, got_state, _ = run_training([f"train.device={device}", *SMALL, *extra])
    assert got["device"].startswith(device)
    _summary_close(got, want)
    assert got_state.keys() == want_state.keys()
    for k in want_state:
        assert got_state[k].device.type == device, k
        assert rel_err(got_state[k], want_state[k]) <= 1e-4, (k, rel_err(got_state[k], want_state[k]))


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_resume_on_device_is_bitwise_identical(device, tmp_path):
    """A run stopped at a checkpoint and resumed equals the uninterrupted run bit for bit. On
    CUDA every op of this model is deterministic run to run without
    ``torch.use_deterministic_algorithms``: ids are sorted stably, each unique row is updated once
    (scatters and index_add_ never meet a repeated index), a bag's sum is one sequential loop,
    reductions are trees in a fixed order, and cuBLAS gives the same bits on one GPU and stream.
    Two uninterrupted runs are compared first, so a non-deterministic op is named as such."""
    ck = f"checkpoint.dir='{tmp_path}'"
    # 2 epochs of 4 steps; checkpoints at steps 3 and 6, a stop at 7, a resume from 6.
    common = [f"train.device={device}", "train.epochs=2", *SMALL]
    full, s_full, seq_full = run_training(common)
    again, s_again, _ = run_training(common)
    for k in s_full:
        assert torch.equal(s_again[k], s_full[k]), f"two uninterrupted runs differ in {k}"
    first, _, seq1 = run_training(common + ["train.max_steps=7", ck, "checkpoint.interval_steps=3",
                                            "checkpoint.at_end=false"])
    assert len(first["checkpoints"]) == 2
    resumed, s_res, seq2 = run_training(common + [ck, "checkpoint.resume=latest", "checkpoint.at_end=false"])
    assert resumed["resumed_from"].endswith("step0000000006")
    assert len(seq_full) == 8 and seq1[:6] + seq2 == seq_full
    for k in ("eval_auc", "eval_logloss", "train_logloss", "steps", "samples"):
        assert resumed[k] == full[k], k
    for k in s_full:
        assert s_res[k].device.type == device
        assert torch.equal(s_res[k], s_full[k]), k


# ---------------------------------------------------------------------------- checkpoint snapshots
@pytest.mark.parametrize("device", DEVICES)
def test_snapshot_copy_and_gather_from_device_equal_cpu(device):
    gen = torch.Generator().manual_seed(5)
    sources = [torch.randn(300, 8, generator=gen), torch.randn(300, 8, generator=gen).to(torch.bfloat16),
               torch.randint(0, 255, (300, 1), generator=gen, dtype=torch.uint8), torch.tensor(17)]
    rows = torch.tensor([3, 3, 0, 299, 150])
    # min_parallel_bytes=0: the CPU side really splits its copies over threads.
    bufs = SnapshotBuffers(threads=2, min_parallel_bytes=0)
    try:
        held: list[torch.Tensor] = []
        for src in sources:
            got, want = bufs.copy(src.to(device), held), bufs.copy(src, held)
            assert got.device.type == "cpu" and got.dtype == src.dtype
            assert torch.equal(got, want) and torch.equal(want, src)
            if src.dim():
                got_rows, want_rows = bufs.gather(src.to(device), rows, held), bufs.gather(src, rows, held)
                assert got_rows.device.type == "cpu"
                assert torch.equal(got_rows, want_rows) and torch.equal(want_rows, src[rows])
        bufs.release(held)
        held = []
        again = bufs.copy(sources[0].to(device), held)  # from a reused buffer
        assert torch.equal(again, sources[0])
    finally:
        bufs.close()


# ---------------------------------------------------------------------------- wire codecs
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "int8"])
def test_wire_codecs_on_device_equal_cpu(device, name):
    """Same bytes on the wire (round-to-nearest conversions; int8's scale and quantisation are
    correctly rounded divisions on both), same decoded values."""
    codec = get_codec(name)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(33, 10, generator=gen) * 3
    x[4] = 1.5  # a constant row: int8's zero-range case
    for shape in ((33, 10), (0, 10), (5, 0)):
        src = x[: shape[0], : shape[1]]
        enc, enc_cpu = codec.encode(src.to(device)), codec.encode(src)
        assert enc.device.type == device and enc.dtype == torch.uint8
        assert enc.shape == (shape[0], codec.row_bytes(shape[1]))
        assert torch.equal(enc.cpu(), enc_cpu), (name, shape)
        dec, dec_cpu = codec.decode(enc, shape[1]), codec.decode(enc_cpu, shape[1])
        assert dec.device.type == device and dec.dtype == torch.float32
        assert torch.equal(dec.cpu(), dec_cpu), (name, shape)


# ---------------------------------------------------------------------------- process groups
def _world_of_one(device: str, tmp_path: Path):
    """A process group of one rank (NCCL on CUDA, gloo on the CPU) over a file store."""
    import torch.distributed as dist

    from recscale.comm.process_group import Topology, init_process_groups

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    return init_process_groups(Topology(1, 0, 1), 60.0, device=torch.device(device), shared_memory=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise", "data_parallel"])
def test_sharded_step_at_world_size_one_matches_one_process(device, sharding, tmp_path):
    """NCCL (gloo on the CPU) at world size 1: the sharded model's collectives all run (to and
    from this one rank); two training steps equal the unsharded CPU model's."""
    import torch.distributed as dist

    from recscale.comm.process_group import destroy_process_groups
    from recscale.sharding.default_plan import default_plan
    from recscale.sharding.shard import shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    groups = _world_of_one(device, tmp_path)
    try:
        assert groups.world_size == 1 and groups.embedding is not None
        assert groups.device.type == device
        if device == "cuda":
            assert dist.get_backend(groups.embedding) == "nccl"
        ref = _dlrm("dot", "fp32", "cpu")
        torch.manual_seed(0)
        emb = TableBatchedEmbeddingBags(_tables(8), OPTIMIZERS["rowwise_adagrad"](), seed=2, device="meta")
        model = DLRM(emb, 5, [16, 8], [16, 1], "fp32", "dot")
        plan = default_plan(_tables(8), groups.topology, sharding)
        model = shard(model, plan, groups).to(groups.device)
        gen = torch.Generator().manual_seed(3)
        for step in range(2):
            dense, sparse = torch.randn(16, 5, generator=gen), _sparse(16, seed=step)
            labels = (torch.rand(16, generator=gen) < 0.3).float()
            outs = []
            for m, dev in ((ref, torch.device("cpu")), (model, groups.device)):
                batch = sparse.to(dev)
                if m is model:
                    m.embeddings.validate(batch)
                    batch = m.embeddings.start_input_dist(batch)
                logits = m(dense.to(dev), batch)
                F.binary_cross_entropy_with_logits(logits, labels.to(dev)).backward()
                outs.append(logits.detach())
            assert rel_err(outs[1], outs[0]) <= 1e-5, (step, rel_err(outs[1], outs[0]))
        for t in _tables(8):
            got = model.embeddings.full_table(t.name)
            assert rel_err(got, ref.embeddings.table_weight(t.name)) <= 1e-5, t.name
            for k, v in model.embeddings.full_state(t.name).items():
                assert rel_err(v, ref.embeddings.table_state(t.name)[k]) <= 1e-5, (t.name, k)
    finally:
        destroy_process_groups()
