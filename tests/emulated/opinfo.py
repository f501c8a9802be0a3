"""PyTorch's OpInfo database, as the emulated tests import it."""

import torch


def op_db() -> list:
    """PyTorch's OpInfo database. Importing it imports torch's test harness, which freezes the
    global backend flags (torch.backends.disable_global_flags) for the whole process: the later
    tests of this session (the programs under test) may set them, so they are thawed again."""
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db as database

    if not frozen:  # the flag lives in the globals of torch.backends' functions
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return database
