"""Patching a module of torch's world when something first imports it, not before.

Inductor and Triton are heavy: a process that never compiles or launches a Triton kernel should
never load them, yet once one is loaded mirage must complete it before the program uses it.
A one-shot meta-path finder sees the module's first import, lets it execute, and then patches it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

from mirage.runtime.unprofiled import unprofiled, unprofiled_around


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after the first import of one module executes, then removes itself."""

    def __init__(self, module_name: str, patch: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self.patch = patch
        # The import system asks every finder: this one is mirage's, not the program's (unprofiled.py).
        self.find_spec = unprofiled(self._find_spec, "find_spec")

    def _find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        patch = self.patch

        def after(module: ModuleType, executed: bool) -> None:
            if executed:
                patch(module)

        # The module's own code is the program's (its profile shows it); the patch is mirage's.
        spec.loader.exec_module = unprofiled_around(spec.loader.exec_module, lambda module: module, after)
        return spec


def after_import(module_name: str, patch: Callable[[ModuleType], None]) -> None:
    """Calls `patch(module)` once `module_name` is imported: now if it already is, else just
    after its first import executes."""
    if module_name in sys.modules:
        patch(sys.modules[module_name])
    else:
        sys.meta_path.insert(0, _AfterImport(module_name, patch))
