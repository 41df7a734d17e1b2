"""One vocabulary for train and eval data, and table sizes taken from the data.

Small generated rating logs (users, items, a multi-hot genre list, a 1-5 rating) go through
``recscale data prepare`` with the ``vocab`` transform and ``recscale train`` with
``model.table_rows = "auto"``."""

import json
from pathlib import Path

import numpy as np
import pytest

from recscale.cli import main
from recscale.data.prepared import PreparedDataset
from recscale.data.stats import read_stats
from recscale.train.config import ConfigError, load_config
from recscale.train.datasets import build_data
from recscale.train.loop import train

SCHEMA = {
    "label": "rating", "label_threshold": 4, "header": True,
    "dense": ["age"],
    "sparse_defaults": {"kind": "string", "transform": "vocab"},
    "sparse": ["user", "item", {"name": "genres", "list_separator": "|"}],
}
GENRES = ["drama", "comedy", "action", "horror", "family"]


def _ratings(path: Path, rows: int, seed: int, users: int = 60, items: int = 80, new_item: bool = False) -> None:
    """Ratings that depend on the user and the item, so a model can learn them."""
    rng = np.random.default_rng(seed)
    taste = np.random.default_rng(0).normal(size=users + 1)
    kind = np.random.default_rng(1).normal(size=items + 2)
    lines = ["user,item,age,genres,rating"]
    for _ in range(rows):
        u, i = int(rng.integers(users)), int(rng.integers(items))
        if new_item and rng.random() < 0.1:
            i = items + 1  # a value the training data never has
        score = taste[u] + kind[i] + rng.normal(scale=0.5)
        rating = int(np.clip(np.round(3 + score), 1, 5))
        genres = "|".join(GENRES[g] for g in sorted({i % 5, (i * 7) % 5}))
        lines.append(f"u{u},m{i},{20 + u % 40},{genres},{rating}")
    path.write_text("\n".join(lines) + "\n")


def _prepare(tmp_path: Path, name: str, inputs: list[Path], *extra: str) -> Path:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / name
    args = ["data", "prepare", "--input", *map(str, inputs), "--format", "csv", "--out", str(out), "--workers", "0",
            "--no-progress", "--row-group-rows", "256"]
    if "--vocab-from" not in extra:
        args += ["--schema", str(schema)]
    assert main(args + list(extra)) == 0
    return out


def _train(train_dir: Path, eval_dir: Path | None = None, *extra: str) -> dict:
    sets = ["data.source=prepared", f"data.train_path=\"{train_dir}\"", "data.num_workers=0", "train.batch_size=128",
            "train.epochs=2", "train.progress=false", "data.shuffle_window=0"]
    sets += [f"data.eval_path=\"{eval_dir}\""] if eval_dir else ["data.eval_fraction=0.2"]
    return train(load_config(None, sets + list(extra)), log=lambda _: None)


@pytest.fixture
def logs(tmp_path):
    _ratings(tmp_path / "train.csv", 2000, seed=1)
    _ratings(tmp_path / "eval.csv", 500, seed=2)
    return tmp_path


def test_eval_with_its_own_vocabulary_is_refused_naming_the_feature(logs, capsys):
    train_dir = _prepare(logs, "train", [logs / "train.csv"])
    eval_dir = _prepare(logs, "eval_own", [logs / "eval.csv"])
    with pytest.raises(ConfigError, match=r"feature 'item' has a different vocabulary.*--vocab-from"):
        _train(train_dir, eval_dir)
    code = main(["train", "--set", "data.source=prepared", "--set", f"data.train_path=\"{train_dir}\"",
                 "--set", f"data.eval_path=\"{eval_dir}\"", "--set", "train.progress=false"])
    assert code == 2 and "feature 'item'" in capsys.readouterr().err


def test_vocab_from_encodes_eval_as_one_directory_and_trains_to_the_same_auc(logs):
    """Eval prepared with the training vocabulary reads exactly as the tail of one directory
    prepared from both files (every eval value occurs in training), so training on the two
    layouts gives the same model and the same eval AUC; no table size is given anywhere."""
    train_dir = _prepare(logs, "train", [logs / "train.csv"])
    eval_dir = _prepare(logs, "eval", [logs / "eval.csv"], "--vocab-from", str(logs / "train"))
    both = _prepare(logs, "both", [logs / "train.csv", logs / "eval.csv"])
    a, b = PreparedDataset.open(train_dir), PreparedDataset.open(eval_dir)
    assert [v["sha256"] for v in a.manifest["vocab"]] == [v["sha256"] for v in b.manifest["vocab"]]
    assert b.manifest["vocab_from"]["fingerprint"] == a.fingerprint
    assert a.table_rows == b.table_rows == PreparedDataset.open(both).table_rows

    separate = _train(train_dir, eval_dir)
    together = _train(both, None)
    assert separate["eval_num_samples"] == together["eval_num_samples"] == 500
    assert separate["eval_auc"] == together["eval_auc"] > 0.75
    assert separate["eval_logloss"] == together["eval_logloss"]


def test_vocab_from_counts_unseen_values_as_out_of_vocabulary(tmp_path):
    _ratings(tmp_path / "train.csv", 1000, seed=1)
    _ratings(tmp_path / "eval.csv", 400, seed=2, new_item=True)
    _prepare(tmp_path, "train", [tmp_path / "train.csv"])
    eval_dir = _prepare(tmp_path, "eval", [tmp_path / "eval.csv"], "--vocab-from", str(tmp_path / "train"))
    new = sum(1 for line in (tmp_path / "eval.csv").read_text().splitlines() if ",m81," in line)
    stats = read_stats(eval_dir / "stats.json")["features"]
    assert new > 0 and stats["item"]["oov_lookups"] == new
    assert stats["item"]["oov_rate"] == pytest.approx(new / 400)
    assert stats["user"]["oov_lookups"] == 0


def test_vocab_from_refuses_other_features_and_other_options(logs, capsys):
    _prepare(logs, "train", [logs / "train.csv"])
    other = dict(SCHEMA, sparse=["user", "item"])
    (logs / "other.json").write_text(json.dumps(other))
    base = ["data", "prepare", "--input", str(logs / "eval.csv"), "--format", "csv", "--out", str(logs / "e"),
            "--workers", "0", "--no-progress", "--vocab-from", str(logs / "train")]
    assert main(base + ["--schema", str(logs / "other.json")]) == 2
    assert "sparse feature 'genres'" in capsys.readouterr().err
    assert main(base + ["--vocab-min-count", "2"]) == 2
    assert "drop --table-rows and --vocab-min-count" in capsys.readouterr().err


def test_explicit_table_rows_are_checked_against_the_prepared_data(logs):
    train_dir = _prepare(logs, "train", [logs / "train.csv"])
    need = PreparedDataset.open(train_dir).table_rows
    data = build_data(load_config(None, ["data.source=prepared", f"data.train_path=\"{train_dir}\""]))
    assert data.table_rows == tuple(need[n] for n in ("user", "item", "genres"))
    small = ["data.source=prepared", f"data.train_path=\"{train_dir}\"", f"model.table_rows=[{need['user']}, 10, 100]"]
    with pytest.raises(ConfigError, match=r"feature item: 10 < .*\"auto\""):
        build_data(load_config(None, small))


def _criteo_tsv(path: Path, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        dense = [str(int(v)) for v in rng.integers(0, 50, 13)]
        sparse = [f"{int(v):08x}" if v else "" for v in rng.integers(0, 40, 26)]  # 0: missing
        lines.append("\t".join([str(int(rng.integers(2))), *dense, *sparse]))
    path.write_text("\n".join(lines) + "\n")


def test_criteo_tsv_auto_sizes_are_a_vocabulary_of_the_training_values(tmp_path):
    _criteo_tsv(tmp_path / "train.tsv", 300, seed=1)
    _criteo_tsv(tmp_path / "eval.tsv", 100, seed=2)
    cfg = load_config(None, ["data.source=criteo_tsv", f"data.train_path=\"{tmp_path / 'train.tsv'}\"",
                             f"data.eval_path=\"{tmp_path / 'eval.tsv'}\"", "data.num_workers=0"])
    data = build_data(cfg)
    ids = data.train_ids
    raw = np.array([[int(c, 16) + 1 if c else 0 for c in line.split("\t")[14:]]
                    for line in (tmp_path / "train.tsv").read_text().splitlines()])
    for j in range(26):
        distinct = np.unique(raw[:, j][raw[:, j] > 0])
        assert data.table_rows[j] == 2 + distinct.size
        # ids 2.. in value order, 0 for missing
        expect = np.where(raw[:, j] > 0, np.searchsorted(distinct, raw[:, j]) + 2, 0)
        assert np.array_equal(ids[:, j], expect)
    assert max(int(b.sparse.values.max()) for b in data.eval) < max(data.table_rows)


def test_errors_a_new_rating_log_meets_name_the_fix(logs, capsys):
    """A rating as the label names label_threshold; a header line read as data names "header"."""
    base = ["data", "prepare", "--input", str(logs / "train.csv"), "--format", "csv", "--out", str(logs / "o"),
            "--workers", "0", "--no-progress"]
    for change, fix in (({"label_threshold": None}, 'set "label_threshold" in the schema'),
                        ({"header": False, "columns": ["user", "item", "age", "genres", "rating"]}, 'set "header": true')):
        schema = {k: v for k, v in {**SCHEMA, **change}.items() if v is not None}
        (logs / "s.json").write_text(json.dumps(schema))
        assert main(base + ["--schema", str(logs / "s.json")]) == 2
        assert fix in capsys.readouterr().err
    cfg = ["--set", "data.source=prepared", "--set", "train.progress=false"]
    assert main(["train", *cfg]) == 2
    assert "'data.train_path': required for data.source = 'prepared'" in capsys.readouterr().err
