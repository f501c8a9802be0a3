"""The device shim's build: cached per source/torch/Python, and robust to a killed build."""

import os
import subprocess
import sys

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
