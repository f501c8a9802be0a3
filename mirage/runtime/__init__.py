"""The in-workload runtime: what runs inside every process of a mirage session.

`site/sitecustomize.py` arms `boot`, which loads the device shim before torch and then
installs `torch_cuda` (the torch.cuda Python API over the shim). The runtime reads only the
environment the launcher exported and never imports the launcher.
"""
