"""The training job's configuration: typed sections read from TOML, overridable with --set.

Every key is a dataclass field with a type, so an unknown key, a wrong type or a bad value is
a one-line error that names the key and what is expected, before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from recscale.checkpoint.settings import CheckpointSettings
from recscale.sharding.types import SHARDING_TYPES
from recscale.train.lr_schedule import LRScheduleConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration problem; the message names the key or path and the fix."""


# The synthetic generator's tables when model.table_rows = "auto": 26 Criteo-like features.
SYNTHETIC_TABLE_ROWS: tuple[int, ...] = (100_000,) * 26

DataSource = Literal["synthetic", "criteo_tsv", "criteo_encoded_csv", "prepared"]


@dataclass
class DataConfig:
    source: DataSource = "synthetic"
    train_path: str = ""
    eval_path: str = ""
    # Share of the training file held out for evaluation when eval_path is empty.
    eval_fraction: float = 0.1
    # Loader worker processes per rank. "auto": none when the rank has 2 usable CPUs or fewer
    # (batches are loaded in the training process between steps, which measured faster than a
    # worker taking a training thread's CPU), else 1 (one worker feeds more than twice the
    # trainer's rate); see recscale/train/process_tuning.py. 0: load in the training process.
    num_workers: int | Literal["auto"] = "auto"
    skip_bad_rows: bool = False
    shuffle: bool = True
    # Synthetic data only.
    num_samples: int = 200_000
    eval_samples: int = 20_000
    pooling_factors: list[int] = field(default_factory=list)
    zipf_alpha: float = 1.05
    # Seed of the samples and of the planted model that labels them (-1: train.seed). Fixed while
    # train.seed varies, runs differ only in initialisation and sample order.
    seed: int = -1
    # Prepared directories only (`recscale data prepare`): samples shuffled together within a
    # window (0: only the row-group order is shuffled), chunks each loader worker decodes
    # ahead, and whether shard checksums are verified when the data is opened.
    shuffle_window: int = 65_536
    prefetch: int = 2
    verify_checksums: bool = True


@dataclass
class ModelConfig:
    embedding_dim: int = 16
    # One table per sparse feature: "auto" takes each table's rows from the data (a prepared
    # directory's manifest, the ids or vocabulary of a Criteo file, the synthetic generator's
    # default shape); a list gives them (checked against the data), a single number applies to all.
    table_rows: list[int] | Literal["auto"] = "auto"
    pooling: Literal["sum", "mean"] = "sum"
    embedding_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    # Embedding kernels: native C++ on the CPU where it builds ("auto"), always ("native"), or
    # the pure-PyTorch ones ("torch"); env RECSCALE_EMBEDDING_KERNEL overrides.
    embedding_kernel: Literal["auto", "native", "torch"] = "auto"
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])
    # MLP and interaction precision: "bf16" = bf16 matmuls with fp32 master weights (opt-in).
    mlp_precision: Literal["fp32", "bf16"] = "fp32"
    # How the bottom-MLP output and the pooled embeddings meet: DLRM's pairwise dot products
    # ("dot"), or DCNv2's low-rank cross network ("dcn": dcn_layers layers of x0 * (W (V x) + b) + x,
    # V and W of rank dcn_low_rank, over all features concatenated; MLPerf DLRM-DCNv2 uses 3 and 512).
    interaction: Literal["dot", "dcn"] = "dot"
    # dcn: cross layers (MLPerf DLRM-DCNv2: 3)
    dcn_layers: int = 3
    # dcn: rank of each layer's low-rank weight W = U V (MLPerf DLRM-DCNv2: 512)
    dcn_low_rank: int = 512

    def rows_for(self, num_features: int) -> list[int]:
        """Rows of each feature's table: one value applies to all, else one per feature
        (``"auto"`` must have been resolved from the data first: ``train.table_sizes``)."""
        if isinstance(self.table_rows, str):
            raise ConfigError("config key 'model.table_rows': 'auto' was not resolved from the data")
        if len(self.table_rows) == 1:
            return self.table_rows * num_features
        if len(self.table_rows) != num_features:
            raise ConfigError(
                f"config key 'model.table_rows' has {len(self.table_rows)} values but the data has "
                f"{num_features} sparse features; give one value per feature or a single value"
            )
        return list(self.table_rows)


@dataclass
class EmbeddingOptimizerConfig:
    name: Literal["sgd", "rowwise_adagrad", "adagrad", "adam"] = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999


@dataclass
class DenseOptimizerConfig:
    name: Literal["sgd", "adagrad", "adam"] = "adagrad"
    lr: float = 0.01
    weight_decay: float = 0.0
    # Adagrad only. torch's defaults (0 and 1e-10) make the first gradient a weight ever gets,
    # however small, a full learning-rate step; a positive start (Keras uses 0.1) keeps tiny
    # gradients small steps, so training does not jump when a unit first turns on.
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10


@dataclass
class TrainConfig:
    batch_size: int = 256
    epochs: int = 1
    # Stop after this many steps (0: run every epoch to the end).
    max_steps: int = 0
    # Evaluate every this many steps as well as at the end (0: only at the end).
    eval_every_steps: int = 0
    eval_batch_size: int = 4096
    seed: int = 0
    # Training (torch) threads per rank. 0: the CPUs this process may use (affinity mask and
    # cgroup quota) split evenly over the ranks of the host, less the loader workers, at least 1.
    threads: int = 0
    # Process-wide tuning (recscale/train/process_tuning.py, logged in one line): size threads
    # and workers as above, let idle OpenMP threads sleep instead of spinning (OMP_WAIT_POLICY),
    # keep freed host memory for reuse. false: PyTorch's and the OS's defaults, threads and
    # workers as given ("auto" workers: none).
    tune_process: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    # Prepare batch i+1 (load, move, validate, send its ids to their owners) while batch i computes.
    pipeline: bool = True
    # Keep freed host memory in the process for the next step instead of returning it to the
    # OS (glibc malloc thresholds, recscale/host_memory.py): fewer page faults per step. Part of
    # the process tuning: off when train.tune_process is false.
    retain_host_memory: bool = True


# Every registered sharding type (recscale/sharding/types/__init__.py), so that adding one needs
# no edit here.
ShardingTypeName = Literal[tuple(SHARDING_TYPES)]  # type: ignore[valid-type]
Precision = Literal["fp32", "fp16", "bf16", "int8"]


@dataclass
class TableShardingConfig:
    type: ShardingTypeName = "table_wise"
    # column_wise only: number of column shards (0: one per rank, at most the dim).
    shards: int = 0


@dataclass
class ShardingConfig:
    # Sharding type of every table without an entry in [sharding.tables]; "auto": the
    # cost-model planner chooses type and ranks per table (tables listed in [sharding.tables]
    # keep their type, the others are table-wise).
    default: Literal[("auto", *SHARDING_TYPES)] = "auto"  # type: ignore[valid-type]
    # A plan JSON file; when set it replaces the default placement.
    plan: str = ""
    # What the "auto" planner costs plans on: a preset (zionex, torchrec-defaults, local-cpu) or a
    # calibrated JSON file from `recscale calibrate`; "" = this machine (its cached calibration
    # when there is one, else local-cpu on CPU and zionex on GPU).
    topology: str = ""
    tables: dict[str, TableShardingConfig] = field(default_factory=dict)


@dataclass
class CommConfig:
    # Wire precision of the forward all-to-all of pooled embeddings.
    forward: Precision = "fp32"
    # Wire precision of the backward all-to-all of embedding gradients.
    backward: Precision = "fp32"
    # Wire precision of the dense gradient all-reduce (int8 is not offered for sums).
    dense: Literal["fp32", "fp16", "bf16"] = "fp32"
    # Multiplies fp16 gradients on the wire so small values do not flush to zero.
    loss_scale: float = 1024.0


@dataclass
class DistConfig:
    # Ranks per host (0: torchrun's LOCAL_WORLD_SIZE); set it to test a multi-host layout on one machine.
    ranks_per_host: int = 0
    # Every collective fails after this many seconds without progress.
    timeout_s: float = 300.0
    # Embedding exchanges between the ranks of one host go through shared memory (CPU, x86).
    shared_memory: bool = True


@dataclass
class TierTableConfig:
    placement: Literal["ram", "ssd"] = "ssd"
    # Rows of this table's RAM cache (0: sized by the planner on the table's miss-ratio curve
    # within tiers.ram_budget_mb).
    cache_rows: int = 0


@dataclass
class TiersConfig:
    # RAM for embedding rows in MiB, per rank: tables that do not fit go to the SSD tier behind
    # a cache (0: every table in RAM, no tier).
    ram_budget_mb: int = 0
    # Directory of the tier files (one per table shard and rank); must exist and be writable.
    ssd_dir: str = ""
    # Which cached rows make room: "lookahead" keeps rows the next batches need.
    policy: Literal["lru", "lfu", "lookahead"] = "lookahead"
    # Batches whose rows are announced ahead of the one training: what lookahead eviction knows.
    lookahead_batches: int = 16
    # Of those, batches whose missing rows are read ahead in the background (at most lookahead_batches).
    prefetch_batches: int = 2
    # Threads reading rows from the tier files in the background.
    io_threads: int = 8
    tables: dict[str, TierTableConfig] = field(default_factory=dict)

    def enabled(self) -> bool:
        return self.ram_budget_mb > 0 or any(t.placement == "ssd" for t in self.tables.values())

    def validate(self) -> None:
        for key in ("ram_budget_mb", "lookahead_batches", "prefetch_batches", "io_threads"):
            _non_negative(f"tiers.{key}", getattr(self, key))
        for name, t in self.tables.items():
            _non_negative(f"tiers.tables.{name}.cache_rows", t.cache_rows)
        if not self.enabled():
            return
        d = Path(self.ssd_dir)
        if not self.ssd_dir:
            raise ConfigError("config key 'tiers.ssd_dir': required when a table is on the SSD tier; name a directory")
        if not d.is_dir():
            raise ConfigError(f"config key 'tiers.ssd_dir': '{d}' is not a directory; create it or choose another")
        if not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(f"config key 'tiers.ssd_dir': '{d}' is not writable; choose a writable directory")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    embedding_optimizer: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)
    dense_optimizer: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    tiers: TiersConfig = field(default_factory=TiersConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- loading
def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or defaults when ``path`` is None), apply ``section.key=value``
    overrides, and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file '{p}' is a directory; give a TOML file (e.g. configs/criteo_10k.toml)")
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(f"config file '{p}' is not valid TOML: {cut(str(e), 200)}") from None
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def config_from_dict(raw: Any) -> Config:
    """A config from ``Config.to_dict()`` (a training summary's ``config``), validated."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set '{item}': expected section.key=value, e.g. train.batch_size=512")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string: --set data.source=synthetic
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        why = "the number has too many digits" if "digits" in str(e) else cut(str(e))
        raise ConfigError(f"--set '{cut(item, 60)}': {why}; give a value in the key's range") from None
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"--set '{item}': '{parts[0]}' is not a section")
    section[parts[1]] = value


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config section [{where}] must be a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            name = f"{where}.{key}" if where else key
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else f"; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key '{name}'{hint}")
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        kwargs[key] = _coerce(hints[key], value, name)
    return cls(**kwargs)


def _describe(tp: Any, article: bool = True) -> str:
    """A type in words for an error message: "an integer", "a list of integers", "'auto'"."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0], article=False)}s"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a, article) for a in typing.get_args(tp))
    names = {int: ("an integer", "integer"), float: ("a number", "number"), str: ("a string", "string"),
             bool: ("true or false", "boolean")}
    return names[tp][0 if article else 1] if tp in names else str(tp)


def _coerce(tp: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, name)
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"config key '{name}': expected one of {list(choices)}, got {short(value)}")
        return value
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{name}': expected a table, got {short(value)}")
        return {str(k): _coerce(val_tp, v, f"{name}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{name}': expected a list, got {short(value)}")
        return [_coerce(item_tp, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        # Each arm in turn (e.g. a list of sizes or "auto"); the error names every form accepted.
        arms = typing.get_args(tp)
        errors = {}
        for arm in arms:
            try:
                return _coerce(arm, value, name)
            except ConfigError as e:
                errors[typing.get_origin(arm)] = e
        if isinstance(value, list) and list in errors:
            raise errors[list]  # it names the bad item
        forms = " or ".join(_describe(arm) for arm in typing.get_args(tp))
        raise ConfigError(f"config key '{name}': expected {forms}, got {short(value)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{name}': expected true or false, got {short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{name}': expected an integer, got {short(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{name}': expected a number, got {short(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"config key '{name}': expected a finite number, got {short(value)}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{name}': expected a string, got {short(value)}")
        return value
    raise ConfigError(f"config key '{name}': unsupported type {tp}")  # pragma: no cover


# ---------------------------------------------------------------------- validation
def validate(cfg: Config) -> None:
    """Value checks that types alone cannot express."""
    d, m, t = cfg.data, cfg.model, cfg.train
    _positive("train.batch_size", t.batch_size)
    _positive("train.epochs", t.epochs)
    _positive("train.eval_batch_size", t.eval_batch_size)
    _non_negative("train.max_steps", t.max_steps)
    _non_negative("train.eval_every_steps", t.eval_every_steps)
    _non_negative("train.threads", t.threads)
    if d.num_workers != "auto":
        _non_negative("data.num_workers", d.num_workers)
    _positive("model.embedding_dim", m.embedding_dim)
    _positive("embedding_optimizer.lr", cfg.embedding_optimizer.lr)
    _positive("dense_optimizer.lr", cfg.dense_optimizer.lr)
    _non_negative("dense_optimizer.initial_accumulator_value", cfg.dense_optimizer.initial_accumulator_value)
    _positive("dense_optimizer.eps", cfg.dense_optimizer.eps)
    if m.table_rows != "auto" and (not m.table_rows or any(r <= 0 for r in m.table_rows)):
        raise ConfigError(
            "config key 'model.table_rows': expected positive row counts, one per sparse feature "
            "(or \"auto\": sizes from the data)"
        )
    for key in ("bottom_mlp", "top_mlp"):
        sizes = getattr(m, key)
        if not sizes or any(s <= 0 for s in sizes):
            raise ConfigError(f"config key 'model.{key}': expected a non-empty list of positive layer sizes")
    if m.bottom_mlp[-1] != m.embedding_dim:
        raise ConfigError(
            f"config key 'model.bottom_mlp': must end with model.embedding_dim ({m.embedding_dim}), "
            f"got {m.bottom_mlp}; e.g. model.bottom_mlp = {[*m.bottom_mlp[:-1], m.embedding_dim]}"
        )
    if m.top_mlp[-1] != 1:
        raise ConfigError(f"config key 'model.top_mlp': must end with 1 (the logit), got {m.top_mlp}")
    if m.interaction == "dcn":
        _positive("model.dcn_layers", m.dcn_layers)
        _positive("model.dcn_low_rank", m.dcn_low_rank)
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    _non_negative("dist.ranks_per_host", cfg.dist.ranks_per_host)
    _positive("comm.loss_scale", cfg.comm.loss_scale)
    if cfg.sharding.plan and not Path(cfg.sharding.plan).is_file():
        raise ConfigError(f"config key 'sharding.plan': file '{cfg.sharding.plan}' does not exist")
    for name, ts in cfg.sharding.tables.items():
        _non_negative(f"sharding.tables.{name}.shards", ts.shards)
    cfg.tiers.validate()
    try:
        cfg.checkpoint.validate()
        cfg.lr_schedule.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"config key 'data.eval_fraction': expected a value in [0, 1), got {d.eval_fraction}")
    if d.source == "synthetic":
        _positive("data.num_samples", d.num_samples)
        _positive("data.eval_samples", d.eval_samples)  # evaluation needs at least one sample
        if d.seed < -1:
            raise ConfigError(f"config key 'data.seed': expected a seed >= 0, or -1 to use train.seed, got {d.seed}")
        if any(f < 1 for f in d.pooling_factors):
            raise ConfigError(
                f"config key 'data.pooling_factors': every mean pooling factor must be >= 1, got {short(d.pooling_factors)}"
            )
        tables = len(SYNTHETIC_TABLE_ROWS) if m.table_rows == "auto" else len(m.table_rows)
        if d.pooling_factors and len(d.pooling_factors) not in (1, tables):
            raise ConfigError(
                f"config key 'data.pooling_factors': expected 1 or {tables} values "
                f"(one per table), got {len(d.pooling_factors)}"
            )
        if d.zipf_alpha <= 0:
            raise ConfigError(f"config key 'data.zipf_alpha': expected > 0, got {d.zipf_alpha}")
    elif d.source == "prepared":
        _non_negative("data.shuffle_window", d.shuffle_window)
        _positive("data.prefetch", d.prefetch)
        for key in ("train_path", "eval_path"):
            p = getattr(d, key)
            if key == "train_path" and not p:
                raise ConfigError(
                    "config key 'data.train_path': required for data.source = 'prepared' "
                    "(a directory made by `recscale data prepare`)"
                )
            if p and not Path(p).is_dir():
                raise ConfigError(
                    f"config key 'data.{key}': '{p}' is not a directory; data.source = 'prepared' reads a "
                    "directory made by `recscale data prepare`"
                )
    else:
        if not d.train_path:
            raise ConfigError(f"config key 'data.train_path': required for data.source = '{d.source}'")
        for key in ("train_path", "eval_path"):
            p = getattr(d, key)
            if p and not Path(p).is_file():
                raise ConfigError(
                    f"config key 'data.{key}': file '{p}' does not exist "
                    f"(relative paths are resolved from the current directory {Path.cwd()})"
                )


def _positive(name: str, v: float) -> None:
    if not v > 0 or v == math.inf:
        raise ConfigError(f"config key '{name}': expected a value > 0 and finite, got {short(v)}")


def _non_negative(name: str, v: float) -> None:
    if not v >= 0 or v == math.inf:
        raise ConfigError(f"config key '{name}': expected a value >= 0 and finite, got {short(v)}")


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to a readable length: an error message stays one short line."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to convert to text
        return "an integer of thousands of digits"
    return cut(text, limit)


def cut(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[: limit - 20]}...{text[-12:]} ({len(text):,} characters)"
