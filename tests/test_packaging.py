"""The built wheel: it carries every native source, and an installed copy trains with the native
interaction kernel (compiled from the installed source on first use)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE_SUFFIXES = (".cpp", ".h", ".cu")


def _native_sources() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "recscale").rglob("*")
            if p.suffix in NATIVE_SUFFIXES and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel`` of a copy of the project (the build leaves ``build/`` and ``*.egg-info``
    behind, which must not land in the working tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT / "recscale", src / "recscale", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out)], check=True, timeout=300)
    (whl,) = out.glob("recscale-*.whl")
    return whl


def test_wheel_holds_every_native_source(wheel):
    sources = _native_sources()
    assert "recscale/model/csrc/interaction_cpu.cpp" in sources
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert sources <= names, f"missing from the wheel: {sorted(sources - names)}"


_RUN = textwrap.dedent("""
    import sys
    import recscale
    from pathlib import Path
    assert Path(recscale.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), recscale.__file__
    from recscale.model import interaction
    calls = []
    native_apply = interaction._NativeInteraction.apply
    def counted(*args):
        calls.append(1)
        return native_apply(*args)
    interaction._NativeInteraction.apply = counted
    from recscale.train.config import load_config
    from recscale.train.loop import train
    cfg = load_config(None, ["data.source=synthetic", "data.num_samples=512", "data.eval_samples=256",
                             "data.pooling_factors=[1, 2]", "data.num_workers=0", "model.table_rows=[100, 50]",
                             "model.embedding_kernel=torch", "train.batch_size=128", "train.progress=false"])
    summary = train(cfg, log=lambda _: None)
    assert summary["steps"] == 4 and summary["world_size"] == 1, summary
    print("native interaction calls", len(calls))
""")


def test_installed_wheel_trains_with_the_native_interaction(wheel, tmp_path):
    """A fresh environment holding only the wheel; torch and the other dependencies come from this
    environment's site-packages (a ``.pth`` line), so nothing is downloaded. The embedding runs its
    PyTorch kernel, so that only the interaction kernel is compiled (about 20 s)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RECSCALE_NATIVE_INTERACTION")}
    # Its own kernel cache: a build folder names its source's path, so the installed copy would
    # otherwise rebuild the shared cache's build of the working tree's source (and back).
    env["RECSCALE_KERNEL_CACHE"] = str(tmp_path / "kernels")
    run = subprocess.run([str(python), "-c", _RUN], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    calls = int(run.stdout.split("native interaction calls")[-1])
    assert calls >= 4, run.stdout  # one forward per training step, and the evaluation's
