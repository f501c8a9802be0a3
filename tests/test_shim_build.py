"""The device shim's build: cached per source/torch/Python, and robust to a killed build."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_a_stale_lock_from_a_killed_build_does_not_hang_the_next(tmp_path):
    env = dict(os.environ, MIRAGE_CACHE_DIR=str(tmp_path))
    where = subprocess.run([sys.executable, "-c", "from mirage.shim.build import library_path; print(library_path())"],
                           cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    build_dir = os.path.dirname(where)
    os.makedirs(build_dir)
    open(os.path.join(build_dir, "lock"), "w").close()  # what torch's cpp_extension leaves when killed
    result = subprocess.run([sys.executable, "-m", "mirage.shim.build"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == where and os.path.exists(where)


def test_two_environments_with_the_same_torch_version_get_their_own_builds(tmp_path):
    """The built libraries link to one installation's libtorch: a second environment (here a
    virtual environment holding the same torch release) must not reuse the first one's."""
    import importlib.metadata
    import shutil

    metadata = next(f for f in importlib.metadata.distribution("torch").files if f.name == "METADATA")
    dist_info = Path(metadata.locate()).parent
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    site = next((tmp_path / "env" / "lib").glob("python*/site-packages"))
    shutil.copytree(dist_info, site / dist_info.name)  # the release's metadata: version and files
    (site / "torch").mkdir()
    paths = "from mirage.shim import build; print(build.library_path()); print(build.nccl_module_path())"
    mine = subprocess.run([sys.executable, "-c", paths], cwd=REPO, capture_output=True, text=True, check=True)
    other = subprocess.run([str(tmp_path / "env" / "bin" / "python"), "-c", paths], cwd=REPO, capture_output=True,
                           text=True, check=True)
    assert mine.stdout.splitlines()[0] != other.stdout.splitlines()[0]
    assert mine.stdout.splitlines()[1] != other.stdout.splitlines()[1]
    # and this environment's build (cached: built once per source and torch) loads this environment's
    # libtorch, which is why another environment may not share it
    built = subprocess.run([sys.executable, "-m", "mirage.shim.build"], cwd=REPO, capture_output=True, text=True,
                           timeout=1800, check=True).stdout.strip()
    assert built == mine.stdout.splitlines()[0]
    torch_lib = Path(metadata.locate()).parent.parent / "torch" / "lib"
    linked = subprocess.run(["ldd", built], capture_output=True, text=True, check=True).stdout
    assert f"libc10.so => {torch_lib}/libc10.so" in linked, linked
