"""Same inputs, same run: the planner's output does not depend on the machine's load, equal
2-rank runs with the planned default give equal summaries (timing fields aside), and
``recscale train --replay`` reruns a recorded run exactly, on its recorded plan."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pytest

import proc_utils
from dist_utils import free_port

from recscale.cli import main
from recscale.planner.hardware import LOCAL_CPU, Hardware
from recscale.train.replay import TIMING_FIELDS, without_timings

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "data.source=synthetic", "data.num_samples=4096", "data.eval_samples=1024", "data.pooling_factors=[1, 3, 2, 1]",
    "data.num_workers=0", "model.table_rows=[1000, 5000, 300, 50]", "train.batch_size=256", "train.progress=false",
    "dist.timeout_s=60",
]


@contextmanager
def cpu_load(n: int = 2) -> Iterator[None]:
    """Another process's busy loops on every core while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            proc_utils.kill_group(p.pid)
            p.wait()


def _env(cache: Path) -> dict[str, str]:
    # The planner's hardware comes from XDG_CACHE_HOME/recscale (none there: the local-cpu preset).
    return {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(cache)}


def _plan(tmp_path: Path, out: str, *extra: str, hash_seed: str = "0") -> str:
    cmd = [sys.executable, "-m", "recscale", "plan", "--config", "configs/synthetic.toml", "--topology", "local-cpu",
           "--world-size", "8", "--out", str(tmp_path / out), *extra]
    env = {**_env(tmp_path), "PYTHONHASHSEED": hash_seed}  # string hashes (set and dict order) differ
    done = proc_utils.run(cmd, cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return re.sub(r"planned in [0-9.]+ s", "planned in - s", done.stdout).replace(str(tmp_path / out), "PLAN")


def test_plan_is_byte_identical_idle_and_under_load(tmp_path):
    # 300 steps stop the search well before it converges (about 1,200 here), so the plan
    # depends on exactly where it stops: a clock-bound search would stop elsewhere under load.
    idle = _plan(tmp_path, "idle.json", "--search-steps", "300", hash_seed="1")
    with cpu_load():
        loaded = _plan(tmp_path, "loaded.json", "--search-steps", "300", hash_seed="2")
    a, b = (tmp_path / "idle.json").read_bytes(), (tmp_path / "loaded.json").read_bytes()
    assert a == b and idle == loaded
    record = json.loads(a)["planner"]
    assert record == {"method": "recscale", "search_steps": 300, "reproducible": True}
    assert "search: 300 of 300 steps" in idle and "not reproducible" not in idle


def test_a_search_cut_by_the_time_limit_says_it_is_not_reproducible(tmp_path, capsys, monkeypatch):
    # In this process: the warning does not depend on string hashing, and a second interpreter
    # would only spend its start-up importing torch.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.chdir(ROOT)
    assert main(["plan", "--config", "configs/synthetic.toml", "--topology", "local-cpu", "--world-size", "8",
                 "--out", str(tmp_path / "cut.json"), "--time-budget", "1e-9"]) == 0
    out = capsys.readouterr().out
    assert "warning: the 1e-09 s time limit stopped the search before its step budget: this plan is not reproducible" in out
    assert json.loads((tmp_path / "cut.json").read_text())["planner"]["reproducible"] is False


def _train2(tmp_path: Path, summary: Path, args: list[str], cache: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "recscale", "train", "--summary-json", str(summary), *args]
    done = proc_utils.run(cmd, cwd=ROOT, env=_env(cache), timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Two 2-rank runs of one config with the planned default, the second under full load."""
    tmp = tmp_path_factory.mktemp("runs")
    sets = [x for o in TINY for x in ("--set", o)]
    idle, loaded = tmp / "idle.json", tmp / "loaded.json"
    log = _train2(tmp, idle, sets, tmp)
    with cpu_load():
        _train2(tmp, loaded, sets, tmp)
    return tmp, json.loads(idle.read_text()), json.loads(loaded.read_text()), log


def test_two_rank_auto_runs_give_equal_summaries_idle_and_under_load(two_rank_runs):
    _, a, b, log = two_rank_runs
    assert a["config"]["sharding"]["default"] == "auto" and a["world_size"] == 2
    assert a["plan"] is not None and a["hardware"]["name"] == "local-cpu" and a["reproducible"] is True
    assert a["plan_search"]["reproducible"] is True and a["plan_search"]["search_steps"] > 0
    assert set(a["versions"]) == {"recscale", "torch", "python"}
    assert a["embedding_kernel"] in ("native", "torch") and a["embedding_kernel_native"] == (a["embedding_kernel"] == "native")
    assert f"embedding kernel {a['embedding_kernel']}" in log
    assert all(k in a for k in TIMING_FIELDS[:3])
    assert without_timings(a) == without_timings(b)


def test_the_recorded_hardware_and_config_plan_the_recorded_plan_again(two_rank_runs):
    from recscale.train.config import config_from_dict
    from recscale.train.model_factory import build_tables
    from recscale.train.planning import auto_plan

    _, a, _, _ = two_rank_runs
    cfg = config_from_dict(a["config"])
    tables = build_tables(cfg, tuple(f"s{i}" for i in range(4)))
    result, hw = auto_plan(cfg, tables, 2, 2, gpu=False, hw=Hardware(**a["hardware"]))
    assert result.plan.to_dict() == a["plan"] and result.plan.digest() == a["plan_digest"]
    assert result.search_record() == a["plan_search"] and asdict(hw) == a["hardware"]


def test_replay_of_a_two_rank_run_reproduces_it_on_its_recorded_plan(two_rank_runs):
    tmp, a, _, _ = two_rank_runs
    # This machine's calibration now says 1 kB per rank: planning again could place nothing,
    # so the replay succeeds only by running the recorded plan on the recorded hardware.
    cache = tmp / "recalibrated"
    (cache / "recscale").mkdir(parents=True)
    (cache / "recscale" / "topology-local-2.json").write_text(json.dumps(asdict(replace(LOCAL_CPU, memory_bytes=1e3))))
    replayed = tmp / "replayed.json"
    log = _train2(tmp, replayed, ["--replay", str(tmp / "idle.json")], cache)
    c = json.loads(replayed.read_text())
    assert f"replaying {tmp / 'idle.json'}" in log
    assert [c[k] for k in ("eval_auc", "eval_logloss", "eval_ne", "train_logloss")] == \
        [a[k] for k in ("eval_auc", "eval_logloss", "eval_ne", "train_logloss")]
    assert without_timings(c) == without_timings(a)


def test_replay_errors_are_one_line(tmp_path, capsys, two_rank_runs):
    tmp, a, _, _ = two_rank_runs
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"eval_auc": 0.5}))
    cases = [
        (["--replay", str(tmp_path / "missing.json")], "no such file"),
        (["--replay", str(bad)], "not valid JSON"),
        (["--replay", str(partial)], "not a replayable training summary"),
        # the recorded run had 2 ranks; this is one process
        (["--replay", str(tmp / "idle.json")], "the run had 2 rank(s), this job has 1; launch it with torchrun --nproc_per_node=2"),
        (["--replay", str(tmp / "idle.json"), "--set", "train.seed=1"], "drop --set"),
    ]
    for args, message in cases:
        assert main(["train", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and err.startswith("recscale: error: --replay") and "\n" not in err, err


def test_replay_of_one_process_run_is_bitwise(tmp_path, capsys):
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    sets = [x for o in TINY + ["train.max_steps=4"] for x in ("--set", o)]
    assert main(["train", "--summary-json", str(first), *sets]) == 0
    assert main(["train", "--summary-json", str(again), "--replay", str(first)]) == 0
    a, b = json.loads(first.read_text()), json.loads(again.read_text())
    assert a["plan"] is None and a["hardware"] is None and a["steps"] == 4
    assert without_timings(a) == without_timings(b)
    assert f"replaying {first}" in capsys.readouterr().out
