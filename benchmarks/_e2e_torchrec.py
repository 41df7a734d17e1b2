"""TorchRec's systems for ``e2e.py`` (optional: only where ``torchrec`` and ``fbgemm_gpu`` import).

* ``torchrec``: TorchRec's ``EmbeddingBagCollection`` inside its ``DLRM`` (``DLRM_DCN`` for the
  cross-network configs), sharded by ``DistributedModelParallel`` with the plan of TorchRec's
  own ``EmbeddingShardingPlanner`` over every sharding type and compute kernel its sharder
  offers on CPU, told the per-table pooling factors (``_torchrec_planner.training_plan``);
  row-wise Adagrad fused into backward (``apply_optimizer_in_backward(RowWiseAdagrad)``), dense
  part data-parallel, input as ``KeyedJaggedTensor``. ``torchrec-tw``: the same, table-wise
  only. ``torchrec-bf16``: its forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
* ``torchrec-ebc``: one process as a single-process TorchRec user runs it, no
  ``DistributedModelParallel`` or DDP: ``FusedEmbeddingBagCollection`` (FBGEMM's table-batched
  CPU kernel with row-wise Adagrad fused into backward) inside the same ``DLRM``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _e2e_spec import ModelSpec
from _e2e_systems import DENSE_LR, EMB_LR, EPS, System, bce, maybe_bf16
from torch import nn

from recscale.comm.local_processes import free_port
from recscale.data import Batch


def _table_configs(spec: ModelSpec, keys: list[str], device: torch.device | None = None) -> list:
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=spec.dim, num_embeddings=rows, feature_names=[k])
            for k, rows in zip(keys, spec.table_rows)]


def _dlrm(spec: ModelSpec, ebc: nn.Module) -> nn.Module:
    """TorchRec's DLRM (dot interaction) or DLRM_DCN (low-rank cross network) over ``ebc``."""
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    common = dict(embedding_bag_collection=ebc, dense_in_features=spec.num_dense,
                  dense_arch_layer_sizes=list(spec.bottom), over_arch_layer_sizes=list(spec.top),
                  dense_device=torch.device("cpu"))
    if spec.interaction == "dcn":
        return DLRM_DCN(dcn_num_layers=spec.dcn_layers, dcn_low_rank_dim=spec.dcn_low_rank, **common)
    return DLRM(**common)


class _TorchRecBase(System):
    """Input conversion, step and profiling names shared by the TorchRec systems."""

    keys: list[str]
    model: nn.Module
    opt: Any
    bf16 = False

    def prepare(self, batch: Batch) -> tuple:
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(keys=self.keys, values=batch.sparse.values, lengths=batch.sparse.lengths)
        return batch.dense, kjt, batch.labels

    def step(self, inp: tuple) -> None:
        dense, kjt, labels = inp
        with maybe_bf16(self.bf16):
            logits = self.model(dense, kjt).squeeze(-1)
        loss = bce(logits, labels)
        self.opt.zero_grad()
        loss.backward()  # FBGEMM updates the rows in backward (DDP all-reduces the MLPs when sharded)
        self.opt.step()

    def _inner(self) -> nn.Module:
        return self.model

    def embedding_modules(self) -> list[nn.Module]:
        return [self._inner().sparse_arch]

    def mlp_modules(self) -> list[nn.Module]:
        inner = self._inner()
        return [inner.dense_arch, inner.inter_arch, inner.over_arch]


class TorchRecSystem(_TorchRecBase):
    name = "torchrec"

    def __init__(self, spec: ModelSpec, table_wise_only: bool = False, bf16: bool = False) -> None:
        from _torchrec_planner import training_plan
        from torchrec import EmbeddingBagCollection
        from torchrec.distributed import DistributedModelParallel
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        torch.manual_seed(0)
        self.spec, self.bf16 = spec, bf16
        if not dist.is_initialized():  # TorchRec shards over a process group even in one process
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        self.keys = [f"s{i}" for i in range(spec.num_features)]
        configs = _table_configs(spec, self.keys)
        model = _dlrm(spec, EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
        apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": EMB_LR, "eps": EPS})
        plan, self.plan_summary = training_plan(
            model, {c.name: float(p) for c, p in zip(configs, spec.pooling)}, spec.batch_size, table_wise_only)
        self.model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
        dense_opt = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(self.model.named_parameters())),
            lambda params: torch.optim.Adagrad(params, lr=DENSE_LR, eps=EPS, fused=True),
        )
        self.opt = CombinedOptimizer([self.model.fused_optimizer, dense_opt])

    def _inner(self) -> nn.Module:
        return self.model.module


class TorchRecEBCSystem(_TorchRecBase):
    name = "torchrec-ebc"

    def __init__(self, spec: ModelSpec) -> None:
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        torch.manual_seed(0)
        self.spec = spec
        self.keys = [f"s{i}" for i in range(spec.num_features)]
        ebc = FusedEmbeddingBagCollection(tables=_table_configs(spec, self.keys), optimizer_type=RowWiseAdagrad,
                                          optimizer_kwargs={"lr": EMB_LR, "eps": EPS}, device=torch.device("cpu"))
        self.model = _dlrm(spec, ebc)
        dense = [p for n, p in self.model.named_parameters() if not n.startswith("sparse_arch.")]
        self.dense_opt = torch.optim.Adagrad(dense, lr=DENSE_LR, eps=EPS, fused=True)
        self.opt = self.dense_opt  # the rows are updated inside backward by FBGEMM
        self.plan_summary = None  # nothing is sharded
