"""The pipelined training loop gives bitwise the results of the unpipelined one, on 1 and 2 ranks."""

from __future__ import annotations

from contextlib import closing

import pytest
import torch

from dist_utils import run_ranks
from recscale.comm.collectives import CommStats
from recscale.comm.dense_sync import DenseGradSync
from recscale.comm.process_group import env_topology, init_process_groups
from recscale.train.config import load_config
from recscale.train.datasets import build_data
from recscale.train.loop import seed_everything
from recscale.train.model_factory import build_dense_optimizer, build_model
from recscale.train.pipeline import TrainPipeline, train_step

OVERRIDES = [
    "data.source=synthetic",
    "data.num_samples=2600",  # 11 batches, the last one short
    "data.eval_samples=256",
    "data.pooling_factors=[1, 3, 2, 1]",
    "data.num_workers=0",
    "model.table_rows=[300, 2000, 120, 40]",
    "model.pooling=mean",  # ids travel with weights too
    "train.batch_size=256",
    "train.max_steps=9",  # stops while the next batch's ids are in flight
    "train.progress=false",
]


def _train_weights(rank: int, world: int, pipeline: bool, sharding: str) -> dict[str, torch.Tensor]:
    """Train as ``recscale train`` does and return every table (whole) and dense parameter."""
    cfg = load_config(None, OVERRIDES + [f"train.pipeline={str(pipeline).lower()}", f"sharding.default={sharding}"])
    groups = init_process_groups(env_topology(), 30.0, device=torch.device("cpu"))
    seed_everything(cfg.train.seed)
    data = build_data(cfg, groups.rank, groups.world_size)
    stats = CommStats()
    model = build_model(cfg, data.sparse_names, data.num_dense, groups.device, groups, stats)
    params = model.dense_parameters()
    opt = build_dense_optimizer(cfg, params)
    sync = DenseGradSync(params, groups.dense, "fp32", 1.0, stats)
    steps = 0
    with closing(TrainPipeline(data.train_loader(), model.embeddings, groups.device, cfg.train.pipeline)) as pipe:
        for batch, sparse in pipe:
            train_step(model, batch, sparse, opt, sync)
            steps += 1
            if steps == cfg.train.max_steps:
                break
    out = {f"dense.{i}": p.detach().clone() for i, p in enumerate(params)}
    emb = model.embeddings
    for t in emb.tables:
        out[t.name] = emb.full_table(t.name) if world > 1 else emb.table_weight(t.name).clone()
    out["comm_calls"] = torch.tensor(stats.calls.get("input_ids", 0))
    return out


def _both(rank: int, world: int, sharding: str) -> tuple[dict, dict]:
    a = _train_weights(rank, world, True, sharding)
    b = _train_weights(rank, world, False, sharding)
    return a, b


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between pipelined and unpipelined training"


def test_pipeline_bitwise_equal_one_process() -> None:
    a, b = _both(0, 1, "table_wise")
    _assert_bitwise(a, b)


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_pipeline_bitwise_equal_two_ranks(sharding: str) -> None:
    results = run_ranks(_both, 2, sharding, timeout_s=120)
    for a, b in results:
        # The pipelined run started one extra id exchange (for the batch after the last step).
        assert int(a.pop("comm_calls")) == 10 and int(b.pop("comm_calls")) == 9
        _assert_bitwise(a, b)
    # ...and both ranks hold the same model.
    _assert_bitwise(results[0][0], results[1][0])


def _loop_summaries(rank: int, world: int) -> list[dict]:
    """The training loop's summaries with the pipeline on and off (``train.max_steps`` set)."""
    from recscale.train import loop

    out = []
    for pipeline in (True, False):
        cfg = load_config(None, OVERRIDES + [f"train.pipeline={str(pipeline).lower()}", "sharding.default=table_wise"])
        groups = init_process_groups(env_topology(), 30.0, device=torch.device("cpu"))
        out.append(loop._train(cfg, groups, lambda _: None))
    return out


def test_loop_prepares_no_batch_past_max_steps() -> None:
    for on, off in run_ranks(_loop_summaries, 2, timeout_s=120):
        # the same ids travel: the pipelined loop starts no exchange for a batch it will not train
        assert on["steps"] == off["steps"] == 9
        assert on["comm_bytes_per_step"]["input_ids"] == off["comm_bytes_per_step"]["input_ids"] > 0
        assert on["train_logloss"] == off["train_logloss"] and on["eval_logloss"] == off["eval_logloss"]
