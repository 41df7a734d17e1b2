"""Checkpoint lineage: every run writes into its own run folder, chains are checked by digest, a
resume from an older checkpoint starts a branch without touching the other one, and `latest`
is the newest run's newest checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_utils import run_dirs, run_training
from recscale.checkpoint.lineage import RUN_FILE, RunInfo
from recscale.checkpoint.manifest import MANIFEST, CheckpointError
from recscale.checkpoint.storage import LocalStorage
from recscale.checkpoint.tools import verify
from recscale.cli import main

COMMON = ["train.epochs=2", "checkpoint.interval_steps=4", "checkpoint.at_end=false"]
NEW_LR = ["embedding_optimizer.lr=0.1", "dense_optimizer.lr=0.02"]


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every committed checkpoint directory: its inode and its manifest's bytes."""
    return {
        str(d.relative_to(root)): (d.stat().st_ino, (d / MANIFEST).read_bytes())
        for d in sorted(root.glob("run-*/step*"))
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Run A to step 12; run B resumed from A's step 8 with another learning rate, to step 16."""
    root = tmp_path_factory.mktemp("mixed")
    ck = f"checkpoint.dir='{root}'"
    run_training(COMMON + [ck, "train.max_steps=12"])
    (run_a,) = run_dirs(root)
    before = snapshot(root)
    assert sorted(before) == [f"{run_a.name}/step{s:010d}" for s in (4, 8, 12)]
    run_training(COMMON + NEW_LR + [ck, "train.max_steps=16", f"checkpoint.resume='{run_a / 'step0000000008'}'"])
    run_b = run_dirs(root)[-1]
    assert run_b != run_a
    return root, run_a, run_b, before


def test_a_branch_never_overwrites_a_checkpoint(mixed):
    root, run_a, run_b, before = mixed
    after = snapshot(root)
    for name, (ino, manifest) in before.items():  # run A's checkpoints: the same directories, unchanged
        assert after[name] == (ino, manifest), name
    assert sorted(set(after) - set(before)) == [f"{run_b.name}/step0000000012", f"{run_b.name}/step0000000016"]
    info = RunInfo.from_json((run_b / RUN_FILE).read_bytes(), "run.json")
    a8 = json.loads((run_a / "step0000000008" / MANIFEST).read_text())
    assert info.parent is not None and info.parent["run"] == run_a.name and info.parent["step"] == 8
    assert info.parent["digest"] == a8["checksum"] and info.parent["newest"] is False
    b16 = json.loads((run_b / "step0000000016" / MANIFEST).read_text())
    b12 = json.loads((run_b / "step0000000012" / MANIFEST).read_text())
    assert b16["run"] == run_b.name and b16["chain"] == ["step0000000012", "step0000000016"]
    assert b16["links"] == [{"name": "step0000000012", "run": run_b.name, "digest": b12["checksum"]}]


def test_storage_refuses_to_replace_a_checkpoint(tmp_path):
    s = LocalStorage(tmp_path)
    for d in ("step1", ".tmp-step1"):
        s.make_dir(d)
        s.write_atomic(f"{d}/f", d.encode())
    with pytest.raises(FileExistsError, match="never overwritten"):
        s.commit(".tmp-step1", "step1")
    assert (tmp_path / "step1" / "f").read_bytes() == b"step1"


def test_resume_latest_restores_the_newest_run_bitwise(mixed, tmp_path):
    root, run_a, run_b, _ = mixed
    # Run B continued without a stop: from A's step 8 with the new learning rate to step 20.
    _, s_ref, seq_ref = run_training(COMMON + NEW_LR + [f"checkpoint.dir='{tmp_path / 'ref'}'", "train.max_steps=20",
                                                        f"checkpoint.resume='{run_a / 'step0000000008'}'"])
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    resumed, s_res, seq = run_training(COMMON + NEW_LR + [f"checkpoint.dir='{copy}'", "checkpoint.resume=latest",
                                                          "train.max_steps=20"])
    assert resumed["resumed_from"] == str(copy / run_b.name / "step0000000016")
    assert resumed["resumed_run"] == run_b.name
    assert seq == seq_ref[8:]  # steps 17..20, the ones run B had not trained
    assert_same(s_res, s_ref)


def test_verify_flags_the_stale_branch_with_its_run(mixed, capsys):
    root, run_a, run_b, _ = mixed
    assert main(["ckpt", "verify", str(run_a / "step0000000012")]) == 0
    out = capsys.readouterr().out
    assert f"stale branch: step0000000012 belongs to run {run_a.name}" in out
    assert f"newest run {run_b.name}" in out and f"{run_a.name} up to step 8 -> {run_b.name}" in out
    assert out.strip().endswith("but it is on a stale branch")
    # A's step 8 is on the newest lineage (B resumed from it); B's newest is the latest.
    assert not any(x.startswith("stale") for x in verify(str(run_a / "step0000000008")))
    assert main(["ckpt", "verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"{run_b.name}/step0000000016" in out and "stale" not in out
    assert main(["ckpt", "list", str(root)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  step")}
    assert "branch from an older checkpoint" in out
    listed = out.split(f"run {run_b.name}")
    assert "step0000000012" in listed[0] and "[stale branch]" in listed[0].split("step0000000012")[-1].splitlines()[0]
    assert "<- latest" in listed[1].split("step0000000016")[-1].splitlines()[0]
    assert lines


def test_a_chain_mixing_two_runs_is_refused(mixed, tmp_path, capsys):
    """A base replaced under the same name by another run's checkpoint: refused by digest."""
    root, run_a, _, _ = mixed
    other = tmp_path / "other"
    run_training(COMMON + NEW_LR + [f"checkpoint.dir='{other}'", "train.max_steps=4"])
    (run_d,) = run_dirs(other)
    copy = tmp_path / "ck"
    shutil.copytree(root, copy)
    base = copy / run_a.name / "step0000000004"
    shutil.rmtree(base)
    shutil.copytree(run_d / "step0000000004", base)
    assert main(["ckpt", "verify", str(copy / run_a.name / "step0000000008")]) == 2
    err = capsys.readouterr().err
    assert f"belongs to run {run_d.name}" in err and f"step0000000008 to run {run_a.name}" in err
    assert "mixes two runs" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="mixes two runs"):
        run_training(["train.epochs=2", f"checkpoint.resume='{copy / run_a.name / 'step0000000008'}'"])


def test_a_linear_resume_prunes_its_parent_run(tmp_path, capsys):
    ck = f"checkpoint.dir='{tmp_path}'"
    run_training(COMMON + [ck, "train.max_steps=8"])
    (run_a,) = run_dirs(tmp_path)
    run_training(COMMON + [ck, "checkpoint.resume=latest", "train.max_steps=12"])
    (run_b,) = run_dirs(tmp_path)  # A deleted once B's first checkpoint was committed
    assert run_b != run_a and not run_a.exists() and (run_b / "step0000000012").is_dir()
    info = RunInfo.from_json((run_b / RUN_FILE).read_bytes(), "run.json")
    assert info.parent is not None and info.parent["run"] == run_a.name and info.parent["newest"] is True
    run_training(COMMON + [ck, "checkpoint.resume=latest", "train.max_steps=16"])
    (run_c,) = run_dirs(tmp_path)
    info = RunInfo.from_json((run_c / RUN_FILE).read_bytes(), "run.json")
    assert [r["run"] for r in [info.parent, *info.ancestors]] == [run_b.name, run_a.name]  # lineage kept
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run_b.name} step0000000012 (continues it)" in out


def test_a_run_folder_and_the_flat_layout_resolve(mixed, tmp_path):
    from recscale.checkpoint.lineage import resolve

    root, run_a, run_b, _ = mixed
    assert resolve(str(run_a))[0].root / resolve(str(run_a))[1] == run_a / "step0000000012"
    storage, name = resolve("latest", str(root))
    assert storage.root / name == run_b / "step0000000016"
    flat = tmp_path / "flat"  # checkpoints written before run folders: <dir>/stepN
    shutil.copytree(run_a, flat)
    os.remove(flat / RUN_FILE)
    storage, name = resolve("latest", str(flat))
    assert (storage.root, name) == (flat, "step0000000012")
    assert any("OK" in line for line in verify(str(flat)))
