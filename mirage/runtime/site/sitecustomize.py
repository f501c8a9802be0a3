"""Entry point of the mirage runtime in every Python process of a mirage session.

`mirage run` puts this directory first on PYTHONPATH, so every interpreter the workload starts
(torchrun workers, multiprocessing children) runs this at start-up. It only arms a hook for
`import torch` (processes that never import torch pay nothing), then hands over to any
sitecustomize the environment already had, which ours would otherwise shadow.

With a fork server (mirage/forkserver), the process first hands its program over to it and
stays behind as its waiter; a process that has a sitecustomize of its own to chain starts
normally (the server has not run that code).
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_package_root = os.path.dirname(os.path.dirname(os.path.dirname(_here)))
# Whether this interpreter finds mirage, asked of its import finders directly: importlib.util
# would cost every process of the session 5 ms of imports (collections, functools, contextlib).
if not any(getattr(finder, "find_spec", None) and finder.find_spec("mirage", None) for finder in sys.meta_path):
    sys.path.append(_package_root)


def _next_sitecustomize() -> str | None:
    """The sitecustomize that ours shadows on sys.path, if there is one."""
    for entry in sys.path:
        if os.path.abspath(entry or ".") == _here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            return candidate
    return None


_chained = _next_sitecustomize()
if os.environ.get("MIRAGE_FORK_SERVER") and _chained is None:
    from mirage.forkserver import client

    client.hand_off()  # returns only when this process starts normally

from mirage.runtime import boot  # noqa: E402

boot.arm()

if _chained is not None:
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_mirage_chained_sitecustomize", _chained)
    if _spec and _spec.loader:
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
