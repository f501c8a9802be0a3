"""The device shim: a small C++ library that gives a CPU-only PyTorch a `cuda` device.

Pure Python cannot make torch report `cuda` tensors (autograd asks the C++ side for a CUDA
device guard), so this one part is native. It is built with torch.utils.cpp_extension against
the installed torch on first use and cached; see `build.py`.
"""
