"""The three training stacks that ``e2e.py`` compares, built from one model description.

Each system trains the same DLRM (same tables, MLPs, dot interaction, row-wise Adagrad for the
embeddings, Adagrad for the MLPs) on the same batches, which come from recscale's synthetic
generator; only the way each stack stores, looks up, updates and communicates differs:

* ``recscale``: ``recscale.train.model_factory.build_model`` (what ``recscale train`` builds), its
  pipelined ``train_step``;
* ``torchrec``: TorchRec's ``EmbeddingBagCollection`` inside TorchRec's own ``DLRM`` model,
  sharded table-wise by ``DistributedModelParallel`` (FBGEMM's fused CPU kernels, exact row-wise
  Adagrad fused into backward via ``apply_optimizer_in_backward(RowWiseAdagrad)``), dense part
  data-parallel, input as ``KeyedJaggedTensor``;
* ``plain``: one ``nn.EmbeddingBag(sparse=True)`` per table, row-wise Adagrad written out on the
  sparse gradients (the usual ten lines; torch has no row-wise Adagrad), ``torch.optim.Adagrad``
  for the MLPs; with several ranks the whole model is wrapped in ``DistributedDataParallel``
  (tables replicated, sparse gradients all-reduced), the plain-PyTorch way to go data-parallel.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from recscale.comm.local_processes import free_port
from recscale.data import Batch, ClickBatches, SyntheticClickData, SyntheticConfig

TABLES_JSON = Path(__file__).resolve().parents[1].parent / "shared/data/tables/criteo_table_sizes.json"
CRITEO_KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                      27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
               2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]  # fmt: skip
MLPERF_POOLING = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
SEED = 2026
EMB_LR, DENSE_LR, EPS = 0.05, 0.01, 1e-8


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark config: the model and the per-rank batch."""

    name: str
    table_rows: tuple[int, ...]
    pooling: tuple[int, ...]  # mean ids per sample of each feature
    dim: int
    bottom: tuple[int, ...]  # layer sizes after the 13 dense inputs; ends with dim
    top: tuple[int, ...]  # layer sizes after the interaction; ends with 1
    batch_size: int  # per rank
    num_dense: int = 13

    @property
    def num_features(self) -> int:
        return len(self.table_rows)

    @property
    def interaction_width(self) -> int:
        f = self.num_features + 1
        return self.dim + f * (f - 1) // 2

    def mlp_flops_per_sample(self) -> float:
        """Forward + backward FLOPs of the matmuls (MLPs and the Gram matrix): 3 x forward."""
        macs, prev = 0, self.num_dense
        for s in self.bottom:
            macs, prev = macs + prev * s, s
        prev = self.interaction_width
        for s in self.top:
            macs, prev = macs + prev * s, s
        f = self.num_features + 1
        macs += f * f * self.dim
        return 3 * 2 * macs


def _table_json() -> dict[str, Any] | None:
    try:
        return json.loads(TABLES_JSON.read_text())
    except (OSError, ValueError):
        return None


def make_spec(name: str, quick: bool = False, batch_size: int | None = None) -> ModelSpec:
    """``criteo-dlrm`` (Criteo Kaggle tables, one id per table, capped at 1M rows, dim 64) or
    ``multi-hot`` (MLPerf DLRM-DCNv2 tables and pooling factors, capped at 500k rows, dim 128);
    ``quick``: rows capped at 10k, batch 256."""
    data = _table_json()
    if name == "criteo-dlrm":
        rows = data["criteo_kaggle_dac"]["rows"] if data else CRITEO_KAGGLE_ROWS
        cap, pooling, dim, bottom, top = 1_000_000, [1] * len(rows), 64, (512, 256, 64), (512, 256, 1)
    elif name == "multi-hot":
        d = data["mlperf_dlrm_dcnv2"] if data else None
        rows = d["rows"] if d else MLPERF_ROWS
        pooling = list(d["pooling_factors"]) if d else MLPERF_POOLING
        cap, dim, bottom, top = 500_000, 128, (256, 128), (256, 1)
    else:
        raise SystemExit(f"unknown config {name!r}: use criteo-dlrm or multi-hot")
    if quick:
        cap = 10_000
    b = batch_size or (256 if quick else 2048)
    return ModelSpec(name, tuple(min(int(r), cap) for r in rows), tuple(int(p) for p in pooling), dim, bottom, top, b)


def make_batches(spec: ModelSpec, rank: int, world: int, count: int) -> list[Batch]:
    """``count`` global batches (this rank's share of each) from recscale's synthetic generator:
    Zipf-skewed ids (alpha 1.05), multi-hot bags, fixed seed; every system gets these."""
    global_batch = spec.batch_size * world
    src = SyntheticClickData(SyntheticConfig(
        num_samples=global_batch * count, table_rows=spec.table_rows, pooling_factors=spec.pooling,
        num_dense=spec.num_dense, seed=SEED,
    ))
    batches = ClickBatches(src, global_batch, shuffle=False, seed=SEED, rank=rank, world_size=world)
    return [batches[i] for i in range(count)]


def embedding_bytes_per_step(spec: ModelSpec, batch: Batch) -> float:
    """Bytes the embedding part must move per step at the least (fp32 rows, row-wise Adagrad):
    forward reads every looked-up row and writes the pooled outputs; backward reads the output
    gradients and reads and writes each unique row and its state once."""
    ids = batch.sparse.values
    lengths = batch.sparse.lengths.view(spec.num_features, -1).sum(1)
    unique = 0
    for f, vals in enumerate(torch.split(ids, lengths.tolist())):
        unique += int(torch.unique(vals).numel())
    b, d = batch.batch_size, spec.dim
    out = b * spec.num_features * d * 4
    return ids.numel() * d * 4 + out + out + unique * (2 * d * 4 + 2 * 4)


# --------------------------------------------------------------------------- common


class System:
    """One training stack: ``prepare`` turns a recscale ``Batch`` into the stack's input (the
    data share of a step), ``step`` trains on it. ``modules`` name the parts whose forward is
    attributed to embeddings or MLPs in the time breakdown."""

    name = ""

    def prepare(self, batch: Batch) -> Any:
        raise NotImplementedError

    def step(self, inp: Any) -> None:
        raise NotImplementedError

    def run(self, batches: list[Batch], start: int, steps: int) -> None:
        for i in range(steps):
            self.step(self.prepare(batches[(start + i) % len(batches)]))

    def embedding_modules(self) -> list[nn.Module]:
        return []

    def mlp_modules(self) -> list[nn.Module]:
        return []


def _bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels)


# --------------------------------------------------------------------------- recscale


class RecscaleSystem(System):
    name = "recscale"

    def __init__(self, spec: ModelSpec, mlp_precision: str = "fp32", pipeline: bool = True) -> None:
        from recscale.comm.collectives import CommStats
        from recscale.comm.dense_sync import DenseGradSync
        from recscale.comm.process_group import env_topology, init_process_groups
        from recscale.train.config import load_config
        from recscale.host_memory import retain_freed_memory
        from recscale.train.model_factory import build_dense_optimizer, build_model

        sets = [
            f"model.table_rows={list(spec.table_rows)}", f"model.embedding_dim={spec.dim}",
            f"model.bottom_mlp={list(spec.bottom)}", f"model.top_mlp={list(spec.top)}",
            f"model.mlp_precision={mlp_precision!r}".replace("'", '"'),
            "embedding_optimizer.name=rowwise_adagrad", f"embedding_optimizer.lr={EMB_LR}",
            f"embedding_optimizer.eps={EPS}", "dense_optimizer.name=adagrad", f"dense_optimizer.lr={DENSE_LR}",
            f"train.pipeline={str(pipeline).lower()}", "train.seed=0",
            # What the planner (sharding.default = "auto") plans for: the real workload.
            f"data.pooling_factors={list(spec.pooling)}",
            f"train.batch_size={spec.batch_size * int(os.environ.get('WORLD_SIZE', '1'))}",
        ]
        # Extra config overrides for experiments, e.g. RECSCALE_E2E_SET="sharding.default=table_wise".
        sets += [x.strip() for x in os.environ.get("RECSCALE_E2E_SET", "").split(";") if x.strip()]
        self.cfg = load_config(None, sets)
        self.groups = init_process_groups(env_topology(), 300.0, device=torch.device("cpu"))
        names = tuple(f"s{i}" for i in range(spec.num_features))
        self.model = build_model(self.cfg, names, spec.num_dense, self.groups.device, self.groups, CommStats())
        params = self.model.dense_parameters()
        self.opt = build_dense_optimizer(self.cfg, params)
        self.sync = DenseGradSync(params, self.groups.dense, "fp32", 1.0)
        if self.cfg.train.retain_host_memory:  # as `recscale train` does, once the model is built
            retain_freed_memory()
        if mlp_precision == "bf16":
            self.name = "recscale-bf16"

    def prepare(self, batch: Batch) -> Batch:
        return batch  # already recscale's own input type

    def run(self, batches: list[Batch], start: int, steps: int) -> None:
        """The loop of ``recscale train``: the pipeline prepares batch i+1 while batch i trains."""
        from contextlib import closing

        from recscale.train.pipeline import TrainPipeline, train_step

        feed = (batches[(start + i) % len(batches)] for i in range(steps))
        with closing(TrainPipeline(feed, self.model.embeddings, self.groups.device, self.cfg.train.pipeline)) as pipe:
            for batch, sparse in pipe:
                train_step(self.model, batch, sparse, self.opt, self.sync)

    def step(self, inp: Batch) -> None:
        self.run([inp], 0, 1)

    def embedding_modules(self) -> list[nn.Module]:
        emb = self.model.embeddings  # sharded: DLRM calls start_forward, the local operator pools
        return [getattr(emb, "local", None) or emb]

    def mlp_modules(self) -> list[nn.Module]:
        return [self.model.bottom, self.model.interaction, self.model.top]


# --------------------------------------------------------------------------- plain PyTorch


class _PlainDLRM(nn.Module):
    """DLRM as one would write it in plain PyTorch (the reference dlrm_s_pytorch.py shape)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embs = nn.ModuleList()
        for rows in spec.table_rows:
            e = nn.EmbeddingBag(rows, spec.dim, mode="sum", sparse=True, include_last_offset=True)
            bound = 1.0 / math.sqrt(rows)
            nn.init.uniform_(e.weight, -bound, bound)
            self.embs.append(e)
        self.bottom = _mlp(spec.num_dense, spec.bottom, True)
        self.top = _mlp(spec.interaction_width, spec.top, False)
        f = spec.num_features + 1
        li, lj = torch.tril_indices(f, f, offset=-1)
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)
        self.f, self.dim = f, spec.dim

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        ly = [e(i, o) for e, i, o in zip(self.embs, ids, offsets)]
        t = torch.cat([x] + ly, dim=1).view(x.shape[0], self.f, self.dim)
        z = torch.bmm(t, t.transpose(1, 2))
        return self.top(torch.cat([x, z[:, self.li, self.lj]], dim=1)).squeeze(1)


def _mlp(n_in: int, sizes: tuple[int, ...], final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, s in enumerate(sizes):
        layers.append(nn.Linear(n_in, s))
        if i < len(sizes) - 1 or final_relu:
            layers.append(nn.ReLU())
        n_in = s
    return nn.Sequential(*layers)


class PlainSystem(System):
    name = "plain"

    def __init__(self, spec: ModelSpec) -> None:
        torch.manual_seed(0)
        self.spec = spec
        self.net = _PlainDLRM(spec)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.model: nn.Module = self.net
        if self.world > 1:
            self.model = nn.parallel.DistributedDataParallel(self.net)
        dense = [p for n, p in self.net.named_parameters() if not n.startswith("embs.")]
        self.dense_opt = torch.optim.Adagrad(dense, lr=DENSE_LR, eps=EPS)
        self.state = [torch.zeros(e.num_embeddings) for e in self.net.embs]  # one Adagrad sum per row

    def prepare(self, batch: Batch) -> tuple:
        k = self.spec.num_features
        lengths = batch.sparse.lengths.view(k, -1)
        counts = lengths.sum(1).tolist()
        offsets = torch.zeros(k, lengths.shape[1] + 1, dtype=torch.int64)
        torch.cumsum(lengths, 1, out=offsets[:, 1:])
        return batch.dense, list(torch.split(batch.sparse.values, counts)), list(offsets), batch.labels

    @torch.no_grad()
    def _rowwise_adagrad(self) -> None:
        with torch.profiler.record_function("plain.embedding_rowwise_adagrad"):
            for e, acc in zip(self.net.embs, self.state):
                g = e.weight.grad.coalesce()
                rows, vals = g.indices()[0], g.values()
                acc.index_add_(0, rows, vals.square().mean(1))
                e.weight.index_add_(0, rows, vals / (acc[rows].sqrt() + EPS).unsqueeze(1), alpha=-EMB_LR)
                e.weight.grad = None

    def step(self, inp: tuple) -> None:
        dense, ids, offsets, labels = inp
        loss = _bce(self.model(dense, ids, offsets), labels)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP sums (sparse) gradients over ranks; the loss is a per-rank mean
        self._rowwise_adagrad()
        self.dense_opt.step()

    def embedding_modules(self) -> list[nn.Module]:
        return list(self.net.embs)

    def mlp_modules(self) -> list[nn.Module]:
        return [self.net.bottom, self.net.top]


# --------------------------------------------------------------------------- TorchRec


def torchrec_available() -> str | None:
    """None when TorchRec and FBGEMM import, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception as e:  # ImportError, or an ABI mismatch surfacing as OSError/RuntimeError
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


class TorchRecSystem(System):
    name = "torchrec"

    def __init__(self, spec: ModelSpec) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding_types import EmbeddingComputeKernel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.types import ShardingType
        from torchrec.models.dlrm import DLRM
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        torch.manual_seed(0)
        self.spec = spec
        if not dist.is_initialized():  # TorchRec shards over a process group even in one process
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        world = dist.get_world_size()
        self.keys = [f"s{i}" for i in range(spec.num_features)]
        configs = [
            EmbeddingBagConfig(name=f"t_{k}", embedding_dim=spec.dim, num_embeddings=rows, feature_names=[k])
            for k, rows in zip(self.keys, spec.table_rows)
        ]
        model = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
            dense_in_features=spec.num_dense, dense_arch_layer_sizes=list(spec.bottom),
            over_arch_layer_sizes=list(spec.top), dense_device=torch.device("cpu"),
        )
        apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": EMB_LR, "eps": EPS})
        constraints = {
            c.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                         compute_kernels=[EmbeddingComputeKernel.FUSED.value])
            for c in configs
        }
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device="cpu", local_world_size=world),
            batch_size=spec.batch_size, constraints=constraints,
        )
        plan = planner.collective_plan(model, None, dist.GroupMember.WORLD)
        self.model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
        dense_opt = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            lambda params: torch.optim.Adagrad(params, lr=DENSE_LR, eps=EPS),
        )
        self.opt = CombinedOptimizer([self.model.fused_optimizer, dense_opt])

    def prepare(self, batch: Batch) -> tuple:
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(keys=self.keys, values=batch.sparse.values, lengths=batch.sparse.lengths)
        return batch.dense, kjt, batch.labels

    def step(self, inp: tuple) -> None:
        dense, kjt, labels = inp
        loss = _bce(self.model(dense, kjt).squeeze(-1), labels)
        self.opt.zero_grad()
        loss.backward()  # FBGEMM updates the rows in backward; DDP all-reduces the MLPs
        self.opt.step()

    def _inner(self) -> nn.Module:
        return self.model.module

    def embedding_modules(self) -> list[nn.Module]:
        return [self._inner().sparse_arch]

    def mlp_modules(self) -> list[nn.Module]:
        inner = self._inner()
        return [inner.dense_arch, inner.inter_arch, inner.over_arch]


BUILDERS: dict[str, Callable[[ModelSpec], System]] = {
    "recscale": lambda spec: RecscaleSystem(spec),
    "recscale-bf16": lambda spec: RecscaleSystem(spec, mlp_precision="bf16"),
    "recscale-nopipe": lambda spec: RecscaleSystem(spec, pipeline=False),
    "torchrec": TorchRecSystem,
    "plain": PlainSystem,
}


# --------------------------------------------------------------------------- time breakdown

_COMM = ("comm:", "c10d", "gloo", "all_to_all", "alltoall", "all2all", "allreduce", "all_reduce", "allgather",
         "all_gather", "record_param_comms", "wait_tensor", "_OutputDist", "_OutputSend", "_OutputRecv", "All2All", "ReduceScatter", "Awaitable")
# "FusedPooling": the torch and the native operators, forward and backward (the fused update).
_EMB = ("e2e.embeddings", "FusedPooling", "EmbeddingBag", "SplitLookup", "fbgemm", "embedding", "Embedding")
_MLP = ("e2e.mlp", "Addmm", "Mm", "Relu", "Threshold", "Bmm", "_TrianglePairs", "_NativeInteraction", "Linear", "Index", "Optimizer.step",
        "BinaryCrossEntropy", "binary_cross_entropy", "Mean", "Squeeze", "Cat", "View", "Transpose", "Unsqueeze", "Div", "Permute")


def _category(name: str) -> str | None:
    if any(p in name for p in _COMM):
        return "comm"
    if any(p in name for p in _EMB):
        return "embeddings"
    if name.startswith("e2e.data"):
        return "data"
    if any(p in name for p in _MLP):
        return "mlp"
    return None


def breakdown(system: System, batches: list[Batch], steps: int) -> dict[str, float]:
    """Share of a profiled step's main-thread time in data, embeddings, MLPs, communication and
    other work. Each operator's own (self) time goes to the category of its outermost enclosing
    event that has one, except that communication anywhere wins (collectives inside an
    embedding module count as communication). Forward phases are marked by hooks on the
    system's modules; backward phases are named by autograd's nodes."""
    handles = []

    def mark(modules: list[nn.Module], label: str) -> None:
        for m in modules:
            ctx: list = []
            handles.append(m.register_forward_pre_hook(
                lambda _m, _i, ctx=ctx: ctx.append(torch.profiler.record_function(label).__enter__())))
            handles.append(m.register_forward_hook(lambda _m, _i, _o, ctx=ctx: ctx.pop().__exit__(None, None, None)))

    mark(system.embedding_modules(), "e2e.embeddings")
    mark(system.mlp_modules(), "e2e.mlp")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                with torch.profiler.record_function("e2e.data"):
                    inp = system.prepare(batches[i % len(batches)])
                system.step(inp)
    finally:
        for h in handles:
            h.remove()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    main = next((e.thread for e in events if e.name == "e2e.data"), None)
    totals = {"data": 0.0, "embeddings": 0.0, "mlp": 0.0, "comm": 0.0, "other": 0.0}
    for e in events:
        if e.thread != main:
            continue
        chain = []
        node = e
        while node is not None:
            chain.append(node.name)
            node = node.cpu_parent
        cats = [_category(n) for n in chain]
        if "comm" in cats:
            cat = "comm"
        else:
            outer = [c for c in reversed(cats) if c is not None]
            cat = outer[0] if outer else "other"
        totals[cat] += e.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}


def peak_rss_bytes() -> int:
    """This process's peak resident set since the last ``reset_peak_rss`` (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
