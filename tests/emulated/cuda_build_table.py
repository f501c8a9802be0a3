"""What a CUDA build of the installed torch has kernels for: native_functions.yaml's `dispatch:`
keys, from the copy torchgen ships in the wheel (the table a CUDA build's dispatcher is generated
from), read without a YAML library."""

from functools import cache
from pathlib import Path

import torchgen


@cache
def dispatch_keys_by_function() -> dict[str, set[str]]:
    """{"aten::name.overload": the keys of its `dispatch:` entries} for every `- func:` entry."""
    table = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    keys: dict[str, set[str]] = {}
    name, in_dispatch = "", False
    for line in table.read_text().splitlines():
        if line.startswith("- func:"):
            name, in_dispatch = "aten::" + line.split(":", 1)[1].strip().split("(")[0], False
            keys[name] = set()
        elif line.strip() == "dispatch:":
            in_dispatch = True
        elif in_dispatch and line.startswith("    ") and ":" in line:
            keys[name].update(key.strip() for key in line.split(":", 1)[0].split(","))
        elif not line.startswith("    "):
            in_dispatch = False
    return keys
