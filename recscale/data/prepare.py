"""``recscale data prepare``: stream raw click logs into Parquet shards, statistics and a manifest.

The main process reads the input in blocks of whole lines (plain or gzip text) or record
batches (Parquet) and hands them to worker processes, at most two per worker in flight, so
memory stays bounded by the block size whatever the input size. Each worker parses, checks and
transforms its block and writes one shard (``part-NNNNN.parquet``, write-then-rename, page
checksums on). Shards are numbered in input order, so the prepared rows keep the file order.
A vocabulary transform adds a first counting pass. ``manifest.json`` (shards with sizes and
SHA-256, the resolved schema, counts) is written last and atomically: a directory without it
is an unfinished prepare, and the reader refuses it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
import zlib
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from glob import glob
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from recscale.atomic import write_text_atomic
from recscale.data.blocks import Block, clean_block, sparse_ids, vocab_keys
from recscale.data.errors import DataFormatError, shown
from recscale.data.staging import check_out, publish, staging, write_error
from recscale.data.prepared import MANIFEST, MANIFEST_FORMAT, PreparedDataset, file_sha256
from recscale.data.schema import DataSchema, SchemaError, criteo_schema, load_schema, override_sparse
from recscale.data.stats import BlockStats, FeatureCounts, stats_document, write_stats
from recscale.data.transforms import count_keys, merge_counts

STATS = "stats.json"
FORMATS = ("criteo-tsv", "csv", "parquet")


@dataclass(frozen=True)
class PrepareOptions:
    inputs: tuple[str, ...]
    fmt: str
    schema: DataSchema
    out: str
    workers: int = 2
    block_bytes: int = 32 << 20
    row_group_rows: int = 32_768
    skip_bad_rows: bool = False
    overwrite: bool = False
    progress: bool = True
    compression: str = "zstd"
    # An earlier prepared directory whose vocabularies and hashing settings this one reuses
    # (eval data prepared like its training data): unseen values get the out-of-vocabulary id.
    vocab_from: str = ""


@dataclass
class PrepareResult:
    out: str
    rows: int
    skipped_rows: int
    skipped_examples: list[str]
    shards: int
    seconds: float
    input_bytes: int
    table_rows: dict[str, int] = field(default_factory=dict)
    # Features whose values fell outside the vocabulary: (lookups, share of the feature's lookups).
    oov: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)


def build_schema(
    fmt: str, schema_path: str | None, table_rows: list[int] | None, vocab_min_count: int | None
) -> DataSchema:
    """The schema for ``--format``: Criteo's built-in one, or the ``--schema`` file, with
    ``--table-rows`` / ``--vocab-min-count`` applied."""
    if schema_path:
        schema = load_schema(schema_path)
    elif fmt == "criteo-tsv":
        schema = criteo_schema(0)
        if table_rows and len(table_rows) == 26:
            schema = schema.with_table_rows({s.name: r for s, r in zip(schema.sparse, table_rows)})
            table_rows = None
    else:
        raise SchemaError(f"--schema: required for --format {fmt} (which columns are label, dense and sparse)")
    if table_rows is not None and len(table_rows) != 1:
        raise SchemaError(f"--table-rows: expected one value (or 26 for criteo-tsv), got {len(table_rows)}")
    try:
        return override_sparse(schema, table_rows[0] if table_rows else None, vocab_min_count)
    except SchemaError as e:
        raise SchemaError(f"{e}; for Criteo pass --table-rows N (hashing) or --vocab-min-count K") from None


def resolve_inputs(pattern_or_paths: list[str]) -> tuple[str, ...]:
    """Expand globs; every path must exist; the order is sorted within each pattern."""
    files: list[str] = []
    for p in pattern_or_paths:
        hits = sorted(glob(p)) if any(c in p for c in "*?[") else [p]
        if not hits or not all(Path(h).is_file() for h in hits):
            raise FileNotFoundError(f"--input: no input file matches '{p}'")
        files.extend(hits)
    return tuple(files)


# ---------------------------------------------------------------------------------- reading
def _open_binary(path: str):
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    return raw, (gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw)


def _text_blocks(opts: PrepareOptions, advance: Callable[[int], None]) -> Iterator[Block]:
    index = 0
    for path in opts.inputs:
        raw, stream = _open_binary(path)
        with raw:
            try:
                for block in _file_blocks(opts, path, raw, stream, index, advance):
                    index += 1
                    yield block
            except (EOFError, zlib.error) as e:
                raise DataFormatError(f"{path}: the gzip stream is truncated or damaged ({e}); "
                                      "download or compress the file again") from None
            except OSError as e:
                if stream is raw:
                    raise
                raise DataFormatError(f"{path}: the gzip stream is truncated or damaged ({e}); "
                                      "download or compress the file again") from None


def _file_blocks(opts: PrepareOptions, path: str, raw, stream, index: int,
                 advance: Callable[[int], None]) -> Iterator[Block]:
    """The blocks of one text file, numbered from ``index``."""
    line = 1
    columns = opts.schema.columns
    if opts.schema.header:
        first = stream.readline()
        if not first:
            return  # an empty file: no header, no rows
        try:
            head = first.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise DataFormatError(f"{path}:1: the header line is not UTF-8 text: is this a binary file?") from None
        columns = tuple(head.split(opts.schema.delimiter))
        line += 1
        missing = [n for n in (opts.schema.label, *opts.schema.dense_names, *opts.schema.sparse_names) if n not in columns]
        if missing:
            raise SchemaError(f"{path}: header has no column(s) {shown(missing)} (header: {shown(head, 120)})")
    if not columns:
        raise SchemaError(f"{path}: the schema needs 'columns' (the file's column names) or header = true")
    rest, pos = b"", raw.tell()
    while True:
        chunk = stream.read(opts.block_bytes)
        advance(raw.tell() - pos)
        pos = raw.tell()
        if not chunk:
            if rest.replace(b"\r", b""):  # a last line without its newline (spaces are a row too)
                yield Block(index, path, line, rest, columns)
                index += 1
            break
        buf = rest + chunk
        cut = buf.rfind(b"\n")
        if cut < 0:
            rest = buf
            continue
        data, rest = buf[: cut + 1], buf[cut + 1 :]
        yield Block(index, path, line, data, columns)
        index += 1
        line += data.count(b"\n")


def _parquet_blocks(opts: PrepareOptions, advance: Callable[[int], None]) -> Iterator[Block]:
    index = 0
    rows_per_batch = max(1, opts.block_bytes // 256)
    for path in opts.inputs:
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise DataFormatError(f"{path}: not a readable Parquet file ({shown(str(e), 120)[1:-1]}); "
                                  "give Parquet files, or --format csv / criteo-tsv for text") from None
        names = set(pf.schema_arrow.names)
        missing = [n for n in (opts.schema.label, *opts.schema.dense_names, *opts.schema.sparse_names) if n not in names]
        if missing:
            raise SchemaError(f"{path}: Parquet file has no column(s) {missing} (it has {sorted(names)})")
        size, first = os.path.getsize(path), 1
        batches = pf.iter_batches(batch_size=rows_per_batch)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except (pa.ArrowException, OSError) as e:  # a damaged page or a cut file
                raise DataFormatError(f"{path}: row {first} on cannot be read ({shown(str(e), 120)[1:-1]}); "
                                      "the Parquet file is damaged or cut") from None
            yield Block(index, path, first, batch)
            index += 1
            first += batch.num_rows
            advance(int(size * batch.num_rows / max(pf.metadata.num_rows, 1)))


# ---------------------------------------------------------------------------------- workers
_STATE: dict[str, Any] = {}


def _init(opts: PrepareOptions, vocab: dict[str, np.ndarray]) -> None:
    _STATE.update(opts=opts, vocab=vocab)


def _count_block(block: Block) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    opts: PrepareOptions = _STATE["opts"]
    clean = clean_block(block, opts.schema, opts.skip_bad_rows)
    counts = {s.name: count_keys(vocab_keys(clean.sparse[s.name])) for s in opts.schema.sparse if s.transform == "vocab"}
    return counts, clean.rows


def _shard_table(schema: DataSchema, labels: np.ndarray, dense: list[np.ndarray], ids: dict[str, np.ndarray], lengths: dict[str, np.ndarray]) -> pa.Table:
    cols: dict[str, pa.Array] = {"label": pa.array(labels)}
    for d, v in zip(schema.dense, dense):
        cols[d.name] = pa.array(v)
    for s in schema.sparse:
        values = ids[s.name]
        values = values.astype(np.int32) if s.table_rows < 2**31 else values
        if s.is_list:
            offsets = np.zeros(lengths[s.name].size + 1, dtype=np.int32)
            np.cumsum(lengths[s.name], out=offsets[1:])
            cols[s.name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        else:
            cols[s.name] = pa.array(values)
    return pa.table(cols)


def _write_block(block: Block) -> tuple[dict[str, Any], BlockStats, int, list[str]]:
    opts: PrepareOptions = _STATE["opts"]
    vocab: dict[str, np.ndarray] = _STATE["vocab"]
    schema = opts.schema
    clean = clean_block(block, schema, opts.skip_bad_rows)
    ids = {s.name: sparse_ids(s, clean.sparse[s.name], vocab.get(s.name)) for s in schema.sparse}
    lengths = {s.name: clean.sparse[s.name].lengths for s in schema.sparse}
    dense = [v for v, _ in clean.dense]
    stats = BlockStats(
        rows=clean.rows,
        positives=float(clean.labels.sum()),
        dense_sum=np.array([float(v.sum(dtype=np.float64)) for v in dense]),
        dense_missing=np.array([int((~p).sum()) for _, p in clean.dense], dtype=np.int64),
        features={
            s.name: FeatureCounts.of_block(
                ids[s.name], lengths[s.name] if s.is_list else (ids[s.name] != 0).astype(np.int64),
                int((ids[s.name] == 1).sum()) if s.transform == "vocab" else 0,
            )
            for s in schema.sparse
        },
    )
    name = f"part-{block.index:05d}.parquet"
    final = Path(opts.out) / name
    tmp = final.with_name(f".{name}.tmp")
    table = _shard_table(schema, clean.labels, dense, ids, lengths)
    pq.write_table(
        table, tmp, row_group_size=opts.row_group_rows, compression=opts.compression, write_page_checksum=True
    )
    digest = file_sha256(tmp)
    os.replace(tmp, final)
    meta = pq.ParquetFile(final).metadata
    shard = {
        "file": name,
        "rows": table.num_rows,
        "row_groups": [meta.row_group(i).num_rows for i in range(meta.num_row_groups)],
        "bytes": final.stat().st_size,
        "sha256": digest,
    }
    return shard, stats, clean.skipped, clean.examples


def _run(
    opts: PrepareOptions, fn: Callable, vocab: dict[str, np.ndarray], desc: str, rows_of: Callable[[Any], int]
) -> Iterator[Any]:
    """Results of ``fn`` over every block, in input order, at most 2 blocks per worker in flight
    (so memory is bounded by the block size); the bar shows input bytes and rows/s."""
    total = sum(os.path.getsize(p) for p in opts.inputs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not opts.progress, dynamic_ncols=True)
    blocks = (_parquet_blocks if opts.fmt == "parquet" else _text_blocks)(opts, bar.update)
    t0, rows = time.perf_counter(), 0

    def done(result: Any) -> Any:
        nonlocal rows
        rows += rows_of(result)
        bar.set_postfix_str(f"{rows:,} rows, {rows / max(time.perf_counter() - t0, 1e-9):,.0f} rows/s")
        return result

    try:
        if opts.workers <= 0:
            _init(opts, vocab)
            for b in blocks:
                yield done(fn(b))
            return
        # forkserver: workers start from a clean process, not a fork of one whose torch/arrow
        # threads may hold locks; an executor (not a Pool) raises if a worker dies instead of
        # waiting for its result forever.
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(opts.workers, mp_context=ctx, initializer=_init, initargs=(opts, vocab)) as pool:
            pending: deque = deque()
            for b in blocks:
                pending.append(pool.submit(fn, b))
                while len(pending) >= 2 * opts.workers:
                    yield done(pending.popleft().result())
            while pending:
                yield done(pending.popleft().result())
    finally:
        bar.close()


# ---------------------------------------------------------------------------------- driver
def _build_vocab(opts: PrepareOptions, out: Path) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    feats = [s for s in opts.schema.sparse if s.transform == "vocab"]
    if not feats:
        return {}, []
    totals = {s.name: (np.zeros(0, np.uint64), np.zeros(0, np.int64)) for s in feats}
    for counts, _ in _run(opts, _count_block, {}, "vocabulary pass", lambda r: r[1]):
        for name, c in counts.items():
            totals[name] = merge_counts(totals[name], c)
    vocab, files = {}, []
    (out / "vocab").mkdir(exist_ok=True)
    for s in feats:
        keys, counts = totals[s.name]
        vocab[s.name] = np.sort(keys[counts >= s.min_count])
        path = out / "vocab" / f"{s.name}.npy"
        tmp = path.with_name(f".{path.name}.tmp.npy")
        np.save(tmp, vocab[s.name])
        os.replace(tmp, path)
        files.append({"file": f"vocab/{s.name}.npy", "bytes": path.stat().st_size, "sha256": file_sha256(path)})
    return vocab, files


def reuse_encoding(schema: DataSchema, source: PreparedDataset) -> DataSchema:
    """``schema`` with every sparse feature encoded as in ``source`` (transform, table rows,
    vocabulary threshold, list layout); both must have the same sparse features."""
    theirs = {s.name: s for s in source.schema.sparse}
    for s in schema.sparse:
        if s.name not in theirs:
            raise SchemaError(f"--vocab-from: '{source.root}' has no sparse feature '{s.name}' (it has {list(theirs)})")
    missing = [n for n in theirs if n not in schema.sparse_names]
    if missing:
        raise SchemaError(f"--vocab-from: sparse feature '{missing[0]}' of '{source.root}' is not in this schema")
    return replace(schema, sparse=tuple(theirs[n] for n in source.schema.sparse_names))


def _copy_vocab(source: PreparedDataset, out: Path) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """The vocabularies of ``source``, copied byte for byte (so their checksums match)."""
    vocab, files = {}, []
    if source.manifest.get("vocab"):
        (out / "vocab").mkdir(exist_ok=True)
    for entry in source.manifest.get("vocab", []):
        src = source.root / entry["file"]
        dst = out / entry["file"]
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        vocab[Path(entry["file"]).stem] = np.load(dst)
        files.append(dict(entry))
    return vocab, files


def _prepare_into(opts: PrepareOptions, out: Path, source: PreparedDataset | None, final: Path) -> PrepareResult:
    """Write the whole prepared directory into ``out`` (the staging folder); manifest last."""
    opts = replace(opts, out=str(out))
    t0 = time.perf_counter()
    vocab, vocab_files = _copy_vocab(source, out) if source is not None else _build_vocab(opts, out)
    schema = opts.schema.with_table_rows({n: 2 + v.size for n, v in vocab.items()})
    opts = replace(opts, schema=schema)
    shards: list[dict[str, Any]] = []
    stats = BlockStats()
    skipped, examples = 0, []
    for shard, st, sk, ex in _run(opts, _write_block, vocab, "prepare", lambda r: r[1].rows):
        if shard["rows"]:
            shards.append(shard)
        else:
            (out / shard["file"]).unlink()
        stats.merge(st)
        skipped += sk
        examples.extend(ex[: max(0, 5 - len(examples))])
    if not stats.rows:
        _refuse_no_rows(opts.inputs, skipped, examples)
    seconds = time.perf_counter() - t0
    table_rows = {s.name: s.table_rows for s in schema.sparse}
    doc = stats_document(stats, schema.dense_names, table_rows)
    write_stats(out / STATS, doc)
    fingerprint = hashlib.sha256(
        json.dumps([schema.to_dict(), [(s["file"], s["sha256"]) for s in shards]], sort_keys=True).encode()
    ).hexdigest()
    manifest = {
        "format": MANIFEST_FORMAT,
        "schema": schema.to_dict(),
        "rows": stats.rows,
        "positive_rate": doc["positive_rate"],
        "skipped_rows": skipped,
        "skipped_examples": examples,
        "shards": shards,
        "vocab": vocab_files,
        "stats": STATS,
        "stats_sha256": file_sha256(out / STATS),
        "inputs": [{"path": p, "bytes": os.path.getsize(p)} for p in opts.inputs],
        "input_format": opts.fmt,
        "fingerprint": fingerprint,
        "created_seconds": seconds,
        "vocab_from": {"path": str(source.root), "fingerprint": source.fingerprint} if source is not None else None,
    }
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return PrepareResult(
        out=str(final),
        rows=stats.rows,
        skipped_rows=skipped,
        skipped_examples=examples,
        shards=len(shards),
        seconds=seconds,
        input_bytes=sum(os.path.getsize(p) for p in opts.inputs),
        table_rows=table_rows,
        oov={n: (f["oov_lookups"], f["oov_rate"]) for n, f in doc["features"].items() if f["oov_lookups"]},
    )


def _refuse_no_rows(inputs: tuple[str, ...], skipped: int, examples: list[str]) -> None:
    if skipped:
        raise DataFormatError(f"--input: no valid rows: all {skipped:,} rows are bad and were skipped, "
                              f"e.g. {examples[0]}")
    empty = [p for p in inputs if os.path.getsize(p) == 0]
    if len(empty) == len(inputs):
        raise DataFormatError(f"--input: '{empty[0]}' is empty" + (" (and so are the others)" if len(empty) > 1 else "")
                              + "; give files with data rows")
    raise DataFormatError(f"--input: no data rows in {shown(list(inputs), 200)} (only empty lines)")


def prepare(opts: PrepareOptions, log: Callable[[str], None] = print) -> PrepareResult:
    """Prepare ``opts.inputs`` into ``opts.out``; returns counts and the rate."""
    if opts.fmt not in FORMATS:
        raise SchemaError(f"--format: expected one of {list(FORMATS)}, got {opts.fmt!r}")
    if opts.row_group_rows <= 0 or opts.block_bytes <= 0:
        raise SchemaError("--row-group-rows and --block-mb must be > 0")
    out = Path(opts.out)
    if opts.vocab_from and Path(opts.vocab_from).resolve() == out.resolve():
        raise SchemaError(f"--vocab-from: '{opts.vocab_from}' is the output directory; give the training data's directory")
    source = PreparedDataset.open(opts.vocab_from) if opts.vocab_from else None
    if source is not None:
        opts = replace(opts, schema=reuse_encoding(opts.schema, source))
    check_out(out, opts.overwrite)
    tmp = staging(out)
    try:
        result = _prepare_into(opts, tmp, source, out)
        publish(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and (err := write_error(e, out)) is not None:
            raise err from None
        raise
    return result
