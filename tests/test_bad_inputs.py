"""Every bad input a user can hand the CLI, in one table: each ends in exit status 2 and exactly
one line on stderr naming the file, line, key or argument (and the fix), with no traceback, no
training step and nothing left behind (not even a hidden temporary file). In-process calls, so the
whole table runs in seconds."""

from __future__ import annotations

import gzip
import json
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import recscale.train.loop as loop
from recscale.cli import main


def tsv_row(i: int, dense: str | None = None) -> str:
    return "\t".join([str(i % 2)] + [dense or str(i % 7)] * 13 + [f"{0x68fd1e64 + i:08x}"] * 26)


GOOD = "".join(tsv_row(i) + "\n" for i in range(40))
TRAIN = ["--set", "model.table_rows=100", "--set", "train.batch_size=8", "--set", "train.progress=false",
         "--set", "data.num_workers=0", "--set", "train.max_steps=1"]
SYNTH = ["--set", "data.num_samples=256", "--set", "data.eval_samples=64", "--set", "model.table_rows=[100, 50]",
         "--set", "train.batch_size=32", "--set", "train.progress=false", "--set", "data.num_workers=0"]
PLAN = {"version": 1, "world_size": 1, "ranks_per_host": 1, "tables": [{"table": "t_s0", "sharding_type": "table_wise",
        "shards": [{"rank": "zero", "row_offset": 0, "num_rows": 100, "col_offset": 0, "num_cols": 16}]}]}


def files(d: Path) -> None:
    """The inputs of the table, written into ``d``."""
    binary = GOOD.encode().splitlines(keepends=True)
    binary.insert(4, b"1\t\xff\xfe\x00\x80" + b"\t5" * 12 + b"\t68fd1e64" * 26 + b"\n")
    (d / "binary.tsv").write_bytes(b"".join(binary))
    (d / "all_binary.tsv").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\n\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\n")
    packed = gzip.compress(GOOD.encode() * 50)
    (d / "truncated.tsv.gz").write_bytes(packed[: len(packed) // 2])
    (d / "empty.tsv").write_bytes(b"")
    (d / "blank.tsv").write_bytes(b"\n\n\r\n")
    (d / "huge.tsv").write_text(GOOD + tsv_row(1, dense="9" * 5000) + "\n")
    (d / "header_yes.json").write_text(json.dumps({"label": "y", "header": "yes", "sparse": [{"name": "u", "table_rows": 9}]}))
    (d / "dense_str.json").write_text(json.dumps({"label": "y", "dense": "age", "sparse": [{"name": "u", "table_rows": 9}],
                                                  "columns": ["y", "age", "u"]}))
    (d / "data.csv").write_text("1,30,7\n0,40,8\n")
    (d / "not.parquet").write_bytes(b"PAR1 but not really")
    (d / "schema.json").write_text(json.dumps({"label": "y", "dense": ["age"], "sparse": [{"name": "u", "table_rows": 9}]}))
    (d / "plan_rank_zero.json").write_text(json.dumps(PLAN))
    (d / "not_json.json").write_bytes(b"\x00\xff not json {")
    (d / "a_file").write_text("x")
    (d / "a_dir").mkdir()


def train_tsv(name: str, *more: str) -> Callable[[Path], list[str]]:
    return lambda d: ["train", "--set", "data.source=criteo_tsv", "--set", f"data.train_path='{d / name}'", *TRAIN, *more]


def prepare(name: str, *more: str, fmt: str = "criteo-tsv", out: str = "out") -> Callable[[Path], list[str]]:
    return lambda d: ["data", "prepare", "--input", str(d / name), "--format", fmt, "--out", str(d / out),
                      "--table-rows", "100", "--workers", "0", "--no-progress", *more]


def synth(*items: str) -> Callable[[Path], list[str]]:
    return lambda d: ["train", *SYNTH, *[x for i in items for x in ("--set", i)]]


@dataclass
class Case:
    argv: Callable[[Path], list[str]]
    expect: tuple[str, ...]  # each must be in the message


CASES: dict[str, Case] = {
    "binary bytes in a TSV, training": Case(train_tsv("binary.tsv"), ("binary.tsv:5", "not UTF-8", "data.skip_bad_rows")),
    "binary TSV, training, skipping bad rows": Case(
        train_tsv("all_binary.tsv", "--set", "data.skip_bad_rows=true"), ("all_binary.tsv", "no valid rows", "all_binary.tsv:1")),
    "binary bytes in a TSV, prepare": Case(prepare("binary.tsv"), ("binary.tsv:5", "not UTF-8", "--skip-bad-rows")),
    "binary TSV, prepare, skipping bad rows": Case(prepare("all_binary.tsv", "--skip-bad-rows"),
                                                   ("all_binary.tsv", "no valid rows")),
    "truncated gzip, training": Case(train_tsv("truncated.tsv.gz"), ("truncated.tsv.gz", "gzip", "truncated")),
    "truncated gzip, prepare": Case(prepare("truncated.tsv.gz"), ("truncated.tsv.gz", "gzip", "truncated")),
    "empty input, prepare": Case(prepare("empty.tsv"), ("empty.tsv", "is empty")),
    "blank input, prepare": Case(prepare("blank.tsv"), ("blank.tsv", "no data rows")),
    "empty data file, training": Case(train_tsv("empty.tsv"), ("empty.tsv", "is empty")),
    "blank data file, training": Case(train_tsv("blank.tsv"), ("blank.tsv", "no data rows")),
    "a huge number in a TSV": Case(train_tsv("huge.tsv"), ("huge.tsv:41", "dense feature I1", "characters")),
    "lr = nan": Case(synth("embedding_optimizer.lr=nan"), ("'embedding_optimizer.lr'",)),
    "lr = inf": Case(synth("dense_optimizer.lr=inf"), ("'dense_optimizer.lr'",)),
    "pooling_factors = [-1]": Case(synth("data.pooling_factors=[-1]"), ("'data.pooling_factors'",)),
    "eval_samples = 0": Case(synth("data.eval_samples=0"), ("'data.eval_samples'",)),
    "a huge number in a config": Case(synth("train.batch_size=" + "9" * 5000), ("train.batch_size", "characters")),
    "--summary-json naming a directory": Case(lambda d: ["train", *SYNTH, "--summary-json", str(d / "a_dir")],
                                              ("--summary-json", "is a directory")),
    "a directory given as a config": Case(lambda d: ["train", "--config", str(d / "a_dir")], ("is a directory",)),
    "--plan not JSON": Case(lambda d: ["train", *SYNTH, "--plan", str(d / "not_json.json")], ("not_json.json", "JSON")),
    "sharding.topology not JSON": Case(synth("sharding.topology='{d}/not_json.json'"), ("sharding.topology",)),
    "rank zero in a plan file": Case(lambda d: ["train", *SYNTH, "--plan", str(d / "plan_rank_zero.json")],
                                     ("'rank' must be an integer",)),
    "plan --replica-error -5": Case(lambda d: ["plan", "--replica-error", "-5"], ("--replica-error",)),
    "plan --world-size 0": Case(lambda d: ["plan", "--world-size", "0"], ("--world-size",)),
    "plan --world-size huge": Case(lambda d: ["plan", "--world-size", "9" * 400], ("--world-size", "characters")),
    "plan --ranks-per-host 0": Case(lambda d: ["plan", "--ranks-per-host", "0"], ("--ranks-per-host",)),
    "plan --time-budget -1": Case(lambda d: ["plan", "--time-budget", "-1"], ("--time-budget",)),
    "plan --out naming a directory": Case(lambda d: ["plan", "--out", str(d / "a_dir")], ("--out", "is a directory")),
    "plan --out unwritable": Case(lambda d: ["plan", "--out", "/proc/recscale-plan.json"], ("--out", "/proc")),
    "ckpt export --out naming a directory": Case(lambda d: ["ckpt", "export", str(d), "--out", str(d / "a_dir")],
                                                 ("--out", "is a directory")),
    "prepare --out naming a file": Case(prepare("binary.tsv", out="a_file"), ("--out", "a_file", "is a file")),
    "prepare --out unwritable": Case(prepare("binary.tsv", out="/proc/recscale-prepared"), ("--out", "/proc")),
    "not a Parquet file, prepare": Case(prepare("not.parquet", "--schema", "{d}/schema.json", fmt="parquet"),
                                        ("not.parquet", "not a readable Parquet file")),
    'schema "header": "yes"': Case(prepare("data.csv", "--schema", "{d}/header_yes.json", fmt="csv"),
                                   ("'header'", "true or false")),
    'schema "dense": "age"': Case(prepare("data.csv", "--schema", "{d}/dense_str.json", fmt="csv"),
                                  ("'dense'", "list")),
}
if torch.cuda.is_available():  # the case needs a machine without a GPU
    CASES.pop("cuda without a GPU", None)
else:
    CASES["cuda without a GPU"] = Case(synth("train.device=cuda"), ("'train.device'",))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    files(d)
    return d


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_a_one_line_error(name, inputs, capsys, monkeypatch):
    case = CASES[name]

    def no_step(*a, **k):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(loop, "train_step", no_step)
    argv = [a.replace("{d}", str(inputs)) for a in case.argv(inputs)]
    before = set(os.listdir(inputs))
    try:
        code = main(argv)
    except BaseException:  # noqa: BLE001 - the point of the test: anything else is a failure
        pytest.fail(f"{name}: raised instead of a one-line error:\n{traceback.format_exc()}")
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert code == 2, (name, code, cap.err)
    assert "Traceback" not in cap.err and len(err.splitlines()) == 1, cap.err
    assert err.startswith("recscale: error: ") and len(err) < 400, err
    for text in case.expect:
        assert text in err, (text, err)
    assert set(os.listdir(inputs)) == before, f"{name}: left behind {set(os.listdir(inputs)) - before}"


def test_binary_rows_are_skipped_and_counted(inputs, capsys):
    """With skipping on, a row of binary bytes is one skipped row, in training and in prepare."""
    code = main(train_tsv("binary.tsv", "--set", "data.skip_bad_rows=true")(inputs))
    assert code == 0
    out = capsys.readouterr().out
    assert "1 bad rows skipped" in out and "binary.tsv:5" in out
    code = main(prepare("binary.tsv", "--skip-bad-rows", out="skipped")(inputs))
    out = capsys.readouterr().out
    assert code == 0 and "prepared 40 rows" in out and "skipped 1 bad rows" in out and "binary.tsv:5" in out
    manifest = json.loads((inputs / "skipped" / "manifest.json").read_text())
    assert manifest["rows"] == 40 and manifest["skipped_rows"] == 1
    # A plain folder's and plain files' permissions, not a temporary folder's owner-only ones.
    assert oct(os.stat(inputs / "skipped").st_mode & 0o777) == oct(0o777 & ~_umask())
    assert oct(os.stat(inputs / "skipped" / "manifest.json").st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
