"""`recscale train` with tables on the SSD tier: the same run as all in RAM, bitwise, with the
tier's figures in the summary; bad [tiers] settings are one-line errors."""

from __future__ import annotations

import pytest

from recscale.train.config import ConfigError, load_config
from recscale.train.loop import train

BASE = [
    "data.source=synthetic",
    "data.num_samples=3300",  # 206 steps of 16, the last one short
    "data.eval_samples=256",
    "data.pooling_factors=[1, 3, 2]",
    "data.num_workers=0",
    "model.table_rows=[300, 900, 60]",
    "model.embedding_dim=8",
    "model.bottom_mlp=[16, 8]",
    "train.batch_size=16",
    "train.eval_every_steps=100",
    "train.progress=false",
    "train.threads=1",
]
TIERED = [
    "tiers.policy=lookahead",
    "tiers.lookahead_batches=3",
    "tiers.io_threads=2",
]


def _tables(cache: dict[str, int]) -> list[str]:
    out = []
    for name, rows in cache.items():
        out += [f'tiers.tables={{ {name} = {{ placement = "ssd", cache_rows = {rows} }} }}']
    return out


@pytest.mark.parametrize("optimizer, extra", [
    ("adam", []),
    ("rowwise_adagrad", ["train.pipeline=false", "tiers.policy=lru"]),  # no prefetch
    ("sgd", ["model.embedding_dtype=fp16", "tiers.policy=lfu"]),  # the torch kernels
    ("adagrad", ["model.embedding_dtype=bf16", "tiers.io_threads=0"]),  # reads on the training thread
])
def test_training_on_the_ssd_tier_equals_training_in_ram(tmp_path, optimizer, extra):
    opt = [f"embedding_optimizer.name={optimizer}"]
    ram = train(load_config(None, BASE + opt + [e for e in extra if not e.startswith("tiers.")]), log=lambda _: None)
    tables = '{ t_s0 = { placement = "ssd", cache_rows = 40 }, t_s1 = { placement = "ssd", cache_rows = 120 } }'
    cfg = load_config(None, BASE + opt + TIERED + extra + [f"tiers.ssd_dir={tmp_path}", f"tiers.tables={tables}"])
    tier = train(cfg, log=lambda _: None)
    assert tier["steps"] == ram["steps"] >= 200
    for k in ("eval_auc", "eval_logloss", "eval_ne", "train_logloss"):
        assert tier[k] == ram[k], k
    assert tier["evals"] == ram["evals"]
    assert 0 < tier["cache_hit_rate"] < 1
    assert tier["ssd_read_mb_per_step"] > 0 and tier["ssd_write_mb_per_step"] > 0
    assert 0 <= tier["io_stall_fraction"] < 1
    assert (tier["prefetched_rows"] > 0) == (cfg.train.pipeline)
    assert "cache_hit_rate" not in ram
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t_s0.0.tier", "t_s1.0.tier"]


def test_bad_tier_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="tiers.ssd_dir': required"):
        load_config(None, BASE + ["tiers.ram_budget_mb=1"])
    with pytest.raises(ConfigError, match="is not a directory"):
        load_config(None, BASE + ["tiers.ram_budget_mb=1", f"tiers.ssd_dir={tmp_path / 'x'}"])
    cfg = load_config(None, BASE + [f"tiers.ssd_dir={tmp_path}", 'tiers.tables={ t_nope = { placement = "ssd" } }'])
    with pytest.raises(ConfigError, match="'tiers.tables.t_nope': no such table"):
        train(cfg, log=lambda _: None)
    cfg = load_config(None, BASE + [f"tiers.ssd_dir={tmp_path}", 'tiers.tables={ t_s1 = { placement = "ssd" } }'])
    with pytest.raises(ConfigError, match="no RAM is left for its cache"):
        train(cfg, log=lambda _: None)


def test_cli_reports_a_cache_smaller_than_a_batch_in_one_line(tmp_path, capsys):
    from recscale.cli import main

    tables = '{ t_s1 = { placement = "ssd", cache_rows = 5 } }'
    args = ["train"] + [a for o in BASE + [f"tiers.ssd_dir={tmp_path}", f"tiers.tables={tables}"] for a in ("--set", o)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("recscale: error: table 't_s1': a batch looks up") and "cache_rows >=" in err
