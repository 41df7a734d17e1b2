"""Sharding plans: which part of which table lives on which rank, readable as JSON.

JSON layout (version 1)::

    {"version": 1, "world_size": 4, "ranks_per_host": 2,
     "tables": [{"table": "t_C1", "sharding_type": "row_wise",
                 "shards": [{"rank": 0, "row_offset": 0, "num_rows": 500, "col_offset": 0, "num_cols": 16}, ...]},
                ...]}

Every shard is a rectangle of its table (a row range times a column range) on one rank.
Table-wise: one shard, the whole table. Column-wise: column ranges. Row-wise: row ranges over
every rank. Table-row-wise: row ranges over the ranks of one host. Data-parallel: the whole
table on every rank. The types themselves, and what makes a plan of each valid, live in
``recscale.sharding.types``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from recscale.atomic import write_text_atomic
from recscale.embedding import TableConfig

# The name of a sharding type: a key of ``recscale.sharding.types.SHARDING_TYPES``.
ShardingTypeName = str
PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan that does not match its tables or topology; the message names the table."""


@dataclass(frozen=True)
class Shard:
    rank: int
    row_offset: int
    num_rows: int
    col_offset: int
    num_cols: int


def _count(v: object, key: str) -> int:
    """A plan's integers are JSON integers >= 0 (not strings, booleans or fractions)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"'{key}' must be an integer >= 0, got {str(v)[:40]!r}")
    return v


@dataclass(frozen=True)
class TablePlan:
    table: str
    sharding_type: ShardingTypeName
    shards: tuple[Shard, ...]

    @property
    def routes_by_row(self) -> bool:
        """Row-split types send each id only to the shard whose row range holds it."""
        return _registry()[self.sharding_type].routes_by_row


@dataclass(frozen=True)
class ShardingPlan:
    world_size: int
    ranks_per_host: int
    tables: tuple[TablePlan, ...]

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.table == name:
                return t
        raise PlanError(f"the plan has no table '{name}'")

    def sharding_types(self) -> dict[str, str]:
        """Table name -> sharding type: what the cost model's plan-wide terms depend on."""
        return {t.table: t.sharding_type for t in self.tables}

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "world_size": self.world_size,
            "ranks_per_host": self.ranks_per_host,
            "tables": [
                {"table": t.table, "sharding_type": t.sharding_type, "shards": [asdict(s) for s in t.shards]}
                for t in self.tables
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json() + "\n")

    @staticmethod
    def from_dict(d: dict, source: str = "plan") -> ShardingPlan:
        if not isinstance(d, dict):
            raise PlanError(f"{source}: a plan is a JSON object, got {type(d).__name__}")
        try:
            if d.get("version") != PLAN_VERSION:
                raise PlanError(f"{source}: unknown plan version {d.get('version')!r}; expected {PLAN_VERSION}")
            tables = []
            for t in d["tables"]:
                if t["sharding_type"] not in _registry():
                    raise PlanError(
                        f"{source}: table '{str(t['table'])[:60]}' has sharding_type {str(t['sharding_type'])[:60]!r}; "
                        f"expected one of {list(_registry())}"
                    )
                shards = tuple(Shard(**{k: _count(s[k], k) for k in Shard.__dataclass_fields__}) for s in t["shards"])
                if not isinstance(t["table"], str):
                    raise TypeError(f"table name {str(t['table'])[:40]!r} is not a string")
                tables.append(TablePlan(t["table"], t["sharding_type"], shards))
            world, per_host = _count(d["world_size"], "world_size"), _count(d["ranks_per_host"], "ranks_per_host")
            if world < 1 or per_host < 1:
                raise ValueError("world_size and ranks_per_host must be >= 1")
            return ShardingPlan(world, per_host, tuple(tables))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"{source}: malformed plan ({type(e).__name__}: {str(e)[:160]})") from None

    @staticmethod
    def load(path: str | Path) -> ShardingPlan:
        p = Path(path)
        if not p.is_file():
            raise PlanError(f"plan file '{p}' does not exist")
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise PlanError(f"plan file '{p}' is not valid JSON: {str(e)[:160]}") from None
        return ShardingPlan.from_dict(d, str(p))

    # ------------------------------------------------------------------ checks
    def validate(self, tables: list[TableConfig]) -> None:
        """Every table planned once; shards cover each table exactly; ranks exist."""
        by_name = {t.name: t for t in tables}
        planned = [t.table for t in self.tables]
        missing = sorted(set(by_name) - set(planned))
        extra = sorted(set(planned) - set(by_name))
        if missing or extra or len(planned) != len(set(planned)):
            raise PlanError(f"plan and model disagree: unplanned tables {missing}, unknown tables {extra}")
        for table_plan in self.tables:
            cfg = by_name[table_plan.table]
            if not table_plan.shards:
                raise PlanError(f"table '{table_plan.table}': no shards")
            for s in table_plan.shards:
                if not 0 <= s.rank < self.world_size:
                    raise PlanError(f"table '{table_plan.table}': shard on rank {s.rank}, outside world size {self.world_size}")
                if s.num_rows <= 0 or s.num_cols <= 0 or s.row_offset < 0 or s.col_offset < 0:
                    raise PlanError(f"table '{table_plan.table}': empty or negative shard {s}")
                if s.row_offset + s.num_rows > cfg.num_rows or s.col_offset + s.num_cols > cfg.dim:
                    raise PlanError(f"table '{table_plan.table}': shard {s} exceeds the table ({cfg.num_rows} x {cfg.dim})")
            _registry()[table_plan.sharding_type].check(table_plan, cfg, self)


def _registry() -> dict:
    """The sharding types by name (imported late: each type's module imports this one)."""
    from recscale.sharding.types import SHARDING_TYPES

    return SHARDING_TYPES
