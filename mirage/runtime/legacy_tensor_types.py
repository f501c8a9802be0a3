"""torch.cuda.FloatTensor and the other legacy per-dtype tensor types, as constructors.

A CPU build keeps the type objects (isinstance checks and `t.type(torch.cuda.FloatTensor)`
work) but compiles their constructor out: `torch.cuda.FloatTensor(2)` raises "not available.
Torch not compiled with CUDA enabled", and torch's type objects cannot be changed from Python.
Each name becomes a class that constructs as the legacy constructor does (sizes, a
torch.Size, data, or no argument; `device=`), by building the tensor with torch's own CPU
legacy constructor, which parses the arguments, and moving it to the device; isinstance,
`Tensor.type(...)` and `torch.set_default_tensor_type(...)` take the class as they took the
type object (it is handed on by name, which torch resolves).
"""

from __future__ import annotations

import functools
from types import ModuleType

_NAMES = ("BFloat16Tensor", "BoolTensor", "ByteTensor", "CharTensor", "DoubleTensor", "FloatTensor", "HalfTensor",
          "IntTensor", "LongTensor", "ShortTensor")


def install(torch: ModuleType) -> None:
    cuda = torch.cuda

    class LegacyTensorType(type):
        def __instancecheck__(cls, obj) -> bool:
            return (isinstance(obj, torch.Tensor) and obj.is_cuda and obj.dtype == cls.dtype
                    and obj.layout == torch.strided)

        def __repr__(cls) -> str:
            return f"<class 'torch.cuda.{cls.__name__}'>"

    def legacy_class(name: str, cpu_type) -> type:
        def construct(cls, *args, device=None):
            target = torch.device("cuda", cuda._utils._get_device_index(device, optional=True))
            if len(args) == 1 and isinstance(args[0], torch.Tensor):
                other = args[0]
                if isinstance(other, cls) and other.device == target:
                    return other
                raise TypeError(f"expected {cls!r} (got {other.type()} on {other.device})")
            return cpu_type(*args).to(target)

        return LegacyTensorType(name, (), {"__new__": construct, "dtype": cpu_type.dtype, "is_cuda": True,
                                           "is_sparse": False, "layout": torch.strided,
                                           "__module__": "torch.cuda"})

    classes = {name: legacy_class(name, getattr(torch, name)) for name in _NAMES}
    for name, cls in classes.items():
        setattr(cuda, name, cls)

    def by_name(value):
        return f"torch.cuda.{value.__name__}" if isinstance(value, LegacyTensorType) else value

    tensor_type = torch.Tensor.type

    @functools.wraps(tensor_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        return tensor_type(self, by_name(dtype), non_blocking, **kwargs) if dtype is not None else tensor_type(self)

    torch.Tensor.type = type_
    set_default = torch.set_default_tensor_type

    @functools.wraps(set_default)
    def set_default_tensor_type(t, /):
        return set_default(by_name(t))

    torch.set_default_tensor_type = set_default_tensor_type
