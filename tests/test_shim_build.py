"""The device shim's build: cached per source, torch binary and Python, and robust to a killed build."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_a_stale_lock_from_a_killed_build_does_not_hang_the_next(tmp_path):
    """A build killed midway leaves cpp_extension's "lock" file in its build folder, on which every
    later build would wait forever. The cache given to the build holds this torch's compiled
    objects and NCCL module (copied from the suite's own build, timestamps kept, so ninja finds them
    up to date): the shim still has to be built, through cpp_extension and its lock, but only linked,
    not compiled again: what is tested is the lock, not the compiler."""
    import shutil

    from mirage.shim import build

    build.build()  # the suite's own cache: built once, then found
    env = dict(os.environ, MIRAGE_CACHE_DIR=str(tmp_path))
    paths = "from mirage.shim import build as b; print(b.library_path()); print(b.objects_dir()); print(b.nccl_module_path())"
    shim, objects, nccl = subprocess.run([sys.executable, "-c", paths], cwd=REPO, env=env, capture_output=True,
                                         text=True, check=True).stdout.split()
    shutil.copytree(build.objects_dir(), objects)
    shutil.copytree(build.nccl_module_path().parent, os.path.dirname(nccl))
    open(os.path.join(objects, "lock"), "w").close()  # what torch's cpp_extension leaves when killed
    result = subprocess.run([sys.executable, "-m", "mirage.shim.build"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == shim and os.path.exists(shim)


def _environment_with_this_torch(root: Path, record_edit=None) -> Path:
    """A virtual environment holding this torch release: its metadata copied (RECORD edited by
    `record_edit` if given) and its package hard-linked, so it is a second installation of the
    same files at another path; everything else it imports comes from this environment."""
    import importlib.metadata
    import shutil
    import site as site_module

    metadata = next(f for f in importlib.metadata.distribution("torch").files if f.name == "METADATA")
    dist_info = Path(metadata.locate()).parent
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next((root / "lib").glob("python*/site-packages"))
    shutil.copytree(dist_info, site / dist_info.name)
    if record_edit:
        record = site / dist_info.name / "RECORD"
        record.write_text(record_edit(record.read_text()))
    subprocess.run(["cp", "-al", str(dist_info.parent / "torch"), str(site / "torch")], check=True)
    (site / "this-environment.pth").write_text("\n".join(site_module.getsitepackages()) + "\n")
    return root / "bin" / "python"


def test_environments_holding_the_same_torch_wheel_share_one_build_and_each_maps_its_own_torch(tmp_path):
    """The native parts are keyed by torch's binaries (the wheel's RECORD hashes), not its path, so
    a second environment with the same wheel (the tutorial's .venv-mi350 beside .venv) does not
    build again; and since they carry no rpath, a workload in the second environment maps that
    environment's libtorch, not the first's. A different libtorch binary gets a build of its own."""
    paths = "from mirage.shim import build; print(build.library_path()); print(build.nccl_module_path())"
    same = _environment_with_this_torch(tmp_path / "same")
    other = _environment_with_this_torch(
        tmp_path / "other", lambda text: text.replace("torch/lib/libtorch_cpu.so,sha256=", "torch/lib/libtorch_cpu.so,sha256=X"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    mine = subprocess.run([sys.executable, "-c", paths], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert subprocess.run([str(same), "-c", paths], env=env, capture_output=True, text=True, check=True).stdout == mine
    differs = subprocess.run([str(other), "-c", paths], env=env, capture_output=True, text=True, check=True).stdout
    assert all(a != b for a, b in zip(mine.splitlines(), differs.splitlines()))

    maps = ("import torch; torch.ones(1, device='cuda'); "
            "print([m.split()[-1] for m in open('/proc/self/maps') if m.rstrip().endswith(('libc10.so', 'mirage_shim.so'))])")
    result = subprocess.run([sys.executable, "-m", "mirage", "run", "--quiet", "--", str(same), "-c", maps],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    mapped = eval(result.stdout.strip().splitlines()[-1])
    assert f"{tmp_path}/same/lib/" in next(m for m in mapped if m.endswith("libc10.so")), mapped
    assert next(m for m in mapped if m.endswith("mirage_shim.so")) == mine.splitlines()[0], mapped
    assert not any("/.venv/" in m for m in mapped), mapped  # nothing of the first environment's torch
