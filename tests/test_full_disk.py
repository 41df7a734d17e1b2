"""A full disk, on a small tmpfs: a checkpoint that no longer fits and a ``data prepare`` that
runs out of space each end in one clear line and exit status 2, with nothing half-written left
visible; the checkpoint before the full disk still verifies and resumes to the same state as a
run that never stopped. Needs permission to mount a tmpfs (root or CAP_SYS_ADMIN); skipped
elsewhere."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import recscale.checkpoint.writer as writer
from ckpt_utils import TINY, run_training
from recscale.cli import main
from recscale.data.prepared import PreparedDataset
from test_bad_inputs import tsv_row


@contextlib.contextmanager
def small_fs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                           capture_output=True, text=True, timeout=30)
        why = (r.stderr.strip() or "mount failed") if r.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:  # no mount program, or it hung
        why = str(e)
    if why:
        pytest.skip(f"cannot mount a tmpfs here ({why}); the full-disk tests need root or CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(fs: Path) -> Path:
    """Write a file until the file system is full; returns it (delete it to free the space)."""
    filler = fs / "filler"
    block = b"\0" * (64 << 10)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def one_line(capsys) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "Traceback" not in cap.err and len(err.splitlines()) == 1 and err.startswith("recscale: error: "), cap.err
    return err


CK = ["train.max_steps=12", "checkpoint.interval_steps=4", "checkpoint.keep_last=0"]


@pytest.mark.parametrize("async_write", [True, False])
def test_a_checkpoint_on_a_full_disk(tmp_path, capsys, monkeypatch, async_write):
    with small_fs(tmp_path / "fs", "16m") as fs:
        root = fs / "ck"
        orig, calls, fillers = writer.write_rank, [], []

        def filled_before_the_second(storage, job):
            calls.append(job.manifest.name)
            if len(calls) == 2:  # the disk fills up while the run goes on
                fillers.append(fill(fs))
            return orig(storage, job)

        monkeypatch.setattr(writer, "write_rank", filled_before_the_second)
        sets = TINY + CK + [f"checkpoint.dir='{root}'", f"checkpoint.async_write={str(async_write).lower()}"]
        args = ["train"] + [x for o in sets for x in ("--set", o)]
        assert main(args) == 2
        err = one_line(capsys)
        assert "checkpoint step0000000008 could not be written" in err and "no space left on the device" in err, err
        monkeypatch.setattr(writer, "write_rank", orig)

        (run,) = [p for p in root.iterdir() if p.is_dir()]
        assert sorted(p.name for p in run.iterdir()) == ["run.json", "step0000000004"]  # no half-written one
        fillers[0].unlink()
        assert main(["ckpt", "verify", str(run / "step0000000004")]) == 0
        assert "intact" in capsys.readouterr().out
        if not async_write:
            return  # the resume below is the same either way
        _, resumed, _ = run_training(CK + [f"checkpoint.dir='{root}'", "checkpoint.resume=latest"])
    _, straight, _ = run_training(["train.max_steps=12"])
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_prepare_on_a_full_disk(tmp_path, capsys):
    src = tmp_path / "big.tsv"
    src.write_text("".join(tsv_row(i, dense=str(i)) + "\n" for i in range(20_000)))
    with small_fs(tmp_path / "fs", "256k") as fs:
        args = ["data", "prepare", "--input", str(src), "--format", "criteo-tsv", "--out", str(fs / "prepared"),
                "--table-rows", "1000000", "--workers", "1", "--block-mb", "0.25", "--compression", "none", "--no-progress"]
        assert main(args) == 2
        err = one_line(capsys)
        assert "--out" in err and "no space left on the device" in err and "nothing was kept" in err, err
        assert list(fs.iterdir()) == []  # nothing half-written, not even hidden
        # A mount point as --out (it cannot be renamed): staged inside it, moved up at the end.
        small = tmp_path / "small.tsv"
        small.write_text("".join(tsv_row(i) + "\n" for i in range(50)))
        args[args.index("--input") + 1], args[args.index("--out") + 1] = str(small), str(fs)
        args[args.index("--workers") + 1] = "0"
        for again in ([], ["--overwrite"]):
            assert main(args + again) == 0, capsys.readouterr().err
            assert sorted(p.name for p in fs.iterdir()) == ["manifest.json", "part-00000.parquet", "stats.json"]
        assert PreparedDataset.open(fs).num_rows == 50
