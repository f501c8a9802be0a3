"""Entry point of the mirage runtime in every Python process of a mirage session.

`mirage run` puts this directory first on PYTHONPATH, so every interpreter the workload starts
(torchrun workers, multiprocessing children) runs this at start-up. It only arms a hook for
`import torch` (processes that never import torch pay nothing), then hands over to any
sitecustomize the environment already had, which ours would otherwise shadow.
"""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_package_root = os.path.dirname(os.path.dirname(os.path.dirname(_here)))
if importlib.util.find_spec("mirage") is None:
    sys.path.append(_package_root)

from mirage.runtime import boot  # noqa: E402

boot.arm()


def _chain_next_sitecustomize() -> None:
    """Runs the sitecustomize that ours shadows on sys.path, if there is one."""
    for entry in sys.path:
        if os.path.abspath(entry or ".") == _here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_mirage_chained_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain_next_sitecustomize()
