"""The training stacks that ``e2e.py`` races, built from one model description.

Each system trains the same DLRM (same tables, MLPs and interaction: DLRM's dot products or
DCNv2's low-rank cross layers; row-wise Adagrad for the embeddings, Adagrad for the MLPs) on the
same batches from recscale's synthetic generator; only the way each stack stores, looks up,
updates and communicates differs:

* ``recscale``: ``recscale.train.model_factory.build_model`` (what ``recscale train`` builds), its
  pipelined ``train_step``; its in-process tuning (``train.tune_process``, ``retain_host_memory``)
  off, so it runs in the harness's environment like everyone else (the huge-page advice on its
  tables is part of the embedding module and stays; the harness's ``glibc.malloc.hugetlb``
  gives every system's large allocations huge pages). ``recscale-tuned``: that tuning on top.
  ``recscale-sharded``: one process through the sharded path (a one-rank process group,
  ``recscale.sharding.shard``, the dense all-reduce). ``recscale-bf16``:
  ``model.mlp_precision = "bf16"``.
* ``plain``: one ``nn.EmbeddingBag(sparse=True)`` per table, row-wise Adagrad written out on the
  sparse gradients (torch has no row-wise Adagrad), ``torch.optim.Adagrad`` for the MLPs (fused, as in
  every system: its best CPU form); with
  several ranks the whole model is wrapped in ``DistributedDataParallel`` (tables replicated,
  sparse gradients all-reduced). ``plain-bf16``: its forward under ``torch.autocast(bfloat16)``.
* TorchRec's systems live in ``_e2e_torchrec``.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _e2e_spec import ModelSpec
from torch import nn

from recscale.data import Batch

EMB_LR, DENSE_LR, EPS = 0.05, 0.01, 1e-8


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


def bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.float(), labels)


def maybe_bf16(enabled: bool) -> contextlib.AbstractContextManager:
    """How a PyTorch user runs a model's matmuls in bf16 on CPU: autocast around the forward."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


# --------------------------------------------------------------------------- recscale


class RecscaleSystem(System):
    name = "recscale"

    def __init__(self, spec: ModelSpec, mlp_precision: str = "fp32", pipeline: bool = True, tuned: bool = False,
                 sharded: bool = False) -> None:
        from recscale.comm.collectives import CommStats
        from recscale.comm.dense_sync import DenseGradSync
        from recscale.comm.process_group import env_topology, init_process_groups
        from recscale.train.config import load_config
        from recscale.train.model_factory import build_dense_optimizer, build_model

        world = int(os.environ.get("WORLD_SIZE", "1"))
        sets = [
            f"model.table_rows={list(spec.table_rows)}", f"model.embedding_dim={spec.dim}",
            f"model.bottom_mlp={list(spec.bottom)}", f"model.top_mlp={list(spec.top)}",
            f'model.mlp_precision="{mlp_precision}"', f'model.interaction="{spec.interaction}"',
            f"model.dcn_layers={spec.dcn_layers}", f"model.dcn_low_rank={spec.dcn_low_rank}",
            "embedding_optimizer.name=rowwise_adagrad", f"embedding_optimizer.lr={EMB_LR}",
            f"embedding_optimizer.eps={EPS}", "dense_optimizer.name=adagrad", f"dense_optimizer.lr={DENSE_LR}",
            f"train.pipeline={str(pipeline).lower()}", "train.seed=0",
            f"train.tune_process={str(tuned).lower()}", f"train.retain_host_memory={str(tuned).lower()}",
            # What the planner (sharding.default = "auto") plans for: the generator's description.
            f"data.pooling_factors={list(spec.pooling)}", f"data.zipf_alpha={spec.zipf_alpha}",
            f"train.batch_size={spec.batch_size * world}",
        ]
        # Extra config overrides for experiments, e.g. RECSCALE_E2E_SET="sharding.default=table_wise".
        sets += [x.strip() for x in os.environ.get("RECSCALE_E2E_SET", "").split(";") if x.strip()]
        self.cfg = load_config(None, sets)
        tuning = None
        if tuned:  # what `recscale train` does in its process: size threads, keep freed memory
            from recscale.train.process_tuning import tune_process

            tuning = tune_process(torch.get_num_threads(), 0, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if sharded and not dist.is_initialized():  # the sharded path needs a process group, even of one
            from recscale.comm.local_processes import free_port

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        self.groups = init_process_groups(env_topology(), 300.0, device=torch.device("cpu"))
        names = tuple(f"s{i}" for i in range(spec.num_features))
        stats = CommStats()
        if sharded and self.groups.world_size == 1:
            self.model = _sharded_one_process(self.cfg, names, spec.num_dense, self.groups, stats)
        else:
            self.model = build_model(self.cfg, names, spec.num_dense, self.groups.device, self.groups, stats)
        params = self.model.dense_parameters()
        self.opt = build_dense_optimizer(self.cfg, params)
        self.sync = DenseGradSync(params, self.groups.dense, "fp32", 1.0)
        if tuning is not None:
            tuning.after_build()
        plan = getattr(self.model.embeddings, "plan", None)
        chosen = _counts(plan.sharding_types().values()) if plan else {"unsharded": 1}
        self.plan_summary = {"chosen": chosen}

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


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _sharded_one_process(cfg, names: tuple[str, ...], num_dense: int, groups, stats) -> nn.Module:
    """``build_model``'s sharded branch at world size 1 (``build_model`` itself shards only on
    several ranks): tables described on the meta device, planned, then sharded."""
    from recscale.embedding import TableBatchedEmbeddingBags, make_optimizer
    from recscale.model import DLRM
    from recscale.sharding.collection import CommPrecision
    from recscale.sharding.shard import shard
    from recscale.train.model_factory import build_plan, build_tables

    eo, m = cfg.embedding_optimizer, cfg.model
    tables = build_tables(cfg, names)
    emb = TableBatchedEmbeddingBags(tables, make_optimizer(eo.name, lr=eo.lr, eps=eo.eps), seed=cfg.train.seed,
                                    device="meta", kernel=m.embedding_kernel)
    model = DLRM(emb, num_dense, m.bottom_mlp, m.top_mlp, m.mlp_precision, m.interaction, m.dcn_layers, m.dcn_low_rank)
    plan = build_plan(cfg, tables, groups)
    precision = CommPrecision(cfg.comm.forward, cfg.comm.backward, cfg.comm.loss_scale)
    return shard(model, plan, groups, precision, stats).to(groups.device)


# --------------------------------------------------------------------------- plain PyTorch


class _PlainDLRM(nn.Module):
    """DLRM as one would write it in plain PyTorch (the reference dlrm_s_pytorch.py shape), with
    DCNv2's low-rank cross layers written out when the spec asks for them."""

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
        self.f, self.dim, self.dcn = f, spec.dim, spec.interaction == "dcn"
        if self.dcn:
            width = f * spec.dim
            rank, layers = spec.dcn_low_rank, range(spec.dcn_layers)
            self.cross_v = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in layers)
            self.cross_w = nn.ModuleList(nn.Linear(rank, width) for _ in layers)
        else:
            li, lj = torch.tril_indices(f, f, offset=-1)
            self.register_buffer("li", li, persistent=False)
            self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        return self.dense_forward(dense, [e(i, o) for e, i, o in zip(self.embs, ids, offsets)])

    def dense_forward(self, dense: torch.Tensor, ly: list[torch.Tensor]) -> torch.Tensor:
        """Everything after the lookups: bottom MLP, interaction, top MLP (on pooled ``ly``)."""
        x = self.bottom(dense)
        if self.dcn:  # x_{l+1} = x_0 * (W (V x_l) + b) + x_l
            x0 = torch.cat([x] + ly, dim=1)
            xl = x0
            for v, w in zip(self.cross_v, self.cross_w):
                xl = x0 * w(v(xl)) + xl
            return self.top(xl).squeeze(1)
        t = torch.cat([x] + ly, dim=1).view(x.shape[0], self.f, self.dim)
        z = torch.bmm(t, t.transpose(1, 2))
        return self.top(torch.cat([x, z[:, self.li, self.lj]], dim=1)).squeeze(1)

    def cross_modules(self) -> list[nn.Module]:
        return [*self.cross_v, *self.cross_w] if self.dcn else []


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

    def __init__(self, spec: ModelSpec, bf16: bool = False) -> None:
        torch.manual_seed(0)
        self.spec, self.bf16 = spec, bf16
        self.net = _PlainDLRM(spec)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.model: nn.Module = self.net
        if self.world > 1:
            self.model = nn.parallel.DistributedDataParallel(self.net)
        dense = [p for n, p in self.net.named_parameters() if not n.startswith("embs.")]
        self.dense_opt = torch.optim.Adagrad(dense, lr=DENSE_LR, eps=EPS, fused=True)
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
        with maybe_bf16(self.bf16):
            logits = self.model(dense, ids, offsets)
        loss = bce(logits, labels)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP sums (sparse) gradients over ranks; the loss is a per-rank mean
        self._rowwise_adagrad()
        self.dense_opt.step()

    def embedding_modules(self) -> list[nn.Module]:
        return list(self.net.embs)

    def mlp_modules(self) -> list[nn.Module]:
        return [self.net.bottom, self.net.top, *self.net.cross_modules()]


# --------------------------------------------------------------------------- registry


def _torchrec(kind: str, bf16: bool = False) -> Callable[[ModelSpec], System]:
    def build(spec: ModelSpec) -> System:
        from _e2e_torchrec import TorchRecEBCSystem, TorchRecSystem

        if kind == "ebc":
            return TorchRecEBCSystem(spec)
        return TorchRecSystem(spec, table_wise_only=kind == "tw", bf16=bf16)

    return build


# Build order is also the priority order when the systems of one config are split into groups
# that fit in memory: the headline comparison first.
BUILDERS: dict[str, Callable[[ModelSpec], System]] = {
    "recscale": lambda spec: RecscaleSystem(spec),
    "torchrec": _torchrec("planner"),
    "plain": lambda spec: PlainSystem(spec),
    "recscale-bf16": lambda spec: RecscaleSystem(spec, mlp_precision="bf16"),
    "torchrec-bf16": _torchrec("planner", bf16=True),
    "plain-bf16": lambda spec: PlainSystem(spec, bf16=True),
    "recscale-tuned": lambda spec: RecscaleSystem(spec, tuned=True),
    "recscale-sharded": lambda spec: RecscaleSystem(spec, sharded=True),
    "torchrec-tw": _torchrec("tw"),
    "torchrec-ebc": _torchrec("ebc"),
    "recscale-nopipe": lambda spec: RecscaleSystem(spec, pipeline=False),
}
TORCHREC_SYSTEMS = ("torchrec", "torchrec-bf16", "torchrec-tw", "torchrec-ebc")
BF16_SYSTEMS = ("recscale-bf16", "torchrec-bf16", "plain-bf16")
ONE_PROCESS_ONLY = ("recscale-sharded", "torchrec-ebc")  # what they isolate only exists at one process


def torchrec_available() -> str | None:
    """None when TorchRec and FBGEMM import, else why not."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception as e:  # ImportError, or an ABI mismatch surfacing as OSError/RuntimeError
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
