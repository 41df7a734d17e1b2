"""Native kernel builds never hang: a killed builder's leftovers are cleared, a stuck one times out.

torch's extension loader waits forever on a ``lock`` file that a killed build leaves behind (a
rank or a test timed out mid-compile); recscale's builder holds an OS lock instead and clears
torch's. These tests reuse the embedding kernels' cached build, so they compile at most once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recscale import native_build
from recscale.embedding import native

import proc_utils

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.failure()}")
REPO = Path(__file__).resolve().parents[1]


def _first_built_name() -> str:
    for flags in native.FLAG_SETS:
        name = native_build.build_name("recscale_embedding", native.SOURCE, flags)
        if any((native_build.cache_root() / name).glob(f"{name}*.so")):
            return name
    raise AssertionError("native.load() succeeded but no build is cached")


def test_stale_torch_lock_left_by_a_killed_build_is_cleared() -> None:
    name = _first_built_name()
    (native_build.cache_root() / name / "lock").write_text("")  # as a SIGKILLed builder leaves it
    code = textwrap.dedent("""
        from recscale.embedding import native
        assert native.load() is not None, native.failure()
        print("loaded")
    """)
    proc = proc_utils.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stdout + proc.stderr
    assert not (native_build.cache_root() / name / "lock").exists()


def test_waiting_for_another_builder_times_out_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _first_built_name()
    monkeypatch.setenv(native_build.TIMEOUT_ENV, "0.5")
    flags = next(f for f in native.FLAG_SETS if native_build.build_name("recscale_embedding", native.SOURCE, f) == name)
    with native_build.build_lock(native_build.cache_root() / f"{name}.lock", 1.0):  # another builder, busy
        t0 = time.monotonic()
        with pytest.raises(native_build.NativeBuildError, match=native_build.TIMEOUT_ENV):
            native_build.build("recscale_embedding", native.SOURCE, [flags], what="test")
        assert time.monotonic() - t0 < 60  # the 0.5 s limit ended the wait, not a hang
    assert native_build.build("recscale_embedding", native.SOURCE, [flags], what="test") is not None


def test_lock_is_released_when_its_holder_is_killed() -> None:
    name = _first_built_name()
    lock = native_build.cache_root() / f"{name}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         f"import time; from recscale import native_build as b\nwith b.build_lock(__import__('pathlib').Path({str(lock)!r}), 5):\n"
         "    print('held', flush=True); time.sleep(600)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.kill()
        holder.wait(timeout=30)
        with native_build.build_lock(lock, 5.0):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_bad_timeout_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_build.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=native_build.TIMEOUT_ENV):
        native_build.build_timeout_s()


def test_a_compile_past_the_limit_is_killed_with_its_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECSCALE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(native_build.TIMEOUT_ENV, "2")
    t0 = time.monotonic()
    with pytest.raises(native_build.NativeBuildError, match="compiling took over"):
        native_build.build("recscale_embedding", native.SOURCE, native.FLAG_SETS, what="test")
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"


def test_each_torch_installation_gets_its_own_build(monkeypatch):
    """torch's build files name the environment's include folders: a second environment with
    the same torch version must not reuse (and silently rebuild) the first one's build."""
    import torch

    flags = native.FLAG_SETS[0]
    here = native_build.build_name("recscale_embedding", native.SOURCE, flags)
    assert native_build.build_name("recscale_embedding", native.SOURCE, flags) == here  # stable
    monkeypatch.setattr(torch, "__file__", "/another/env/site-packages/torch/__init__.py")
    assert native_build.build_name("recscale_embedding", native.SOURCE, flags) != here
