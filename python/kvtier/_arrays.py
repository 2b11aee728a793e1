"""Between kvtier's bytes and numpy arrays or torch tensors.

Loaded tensors are views, not copies: each file's bytes are one
``kvtier._kvtier.HostBuffer``; ``numpy.asarray`` makes a ``uint8`` array
over it (numpy's array interface, with the buffer as the array's base) and
every tensor is a slice of that array viewed as its dtype; torch tensors are
made from those arrays with ``torch.from_numpy``, which shares the memory.
The buffer is freed when the last array or tensor viewing it is gone.

A tensor whose bytes are not aligned to its element size (possible in a
safetensors file written by another tool; never in files written by the
``safetensors`` package or by kvtier) is copied into a fresh, aligned array.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from . import _kvtier
from .errors import InvalidTensorError, UnsupportedDtypeError

#: ``framework`` values accepted by the loaders.
Framework = Literal["numpy", "np", "pt", "torch"]

# safetensors dtype name -> numpy dtype (little-endian, as in the files).
_NUMPY: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
}
# Dtypes numpy lacks: a same-size integer stands in for them on the way to
# torch (the tensor is then viewed as its real dtype).
_STAND_IN: dict[str, np.dtype[Any]] = {
    "BF16": np.dtype("<i2"),
    "F8_E5M2": np.dtype("u1"),
    "F8_E4M3": np.dtype("u1"),
}
# safetensors dtype name -> torch dtype attribute name.
_TORCH: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}

Span = tuple[str, str, Sequence[int], int, int, int]


def framework_name(framework: str) -> Literal["numpy", "pt"]:
    """``"numpy"`` for ``"numpy"``/``"np"``, ``"pt"`` for ``"pt"``/``"torch"``."""
    if framework in ("numpy", "np"):
        return "numpy"
    if framework in ("pt", "torch"):
        return "pt"
    raise ValueError(f"framework must be 'numpy' or 'pt', not {framework!r}")


def build(
    buffers: Sequence[_kvtier.HostBuffer],
    spans: Sequence[Span],
    framework: Literal["numpy", "pt"],
) -> dict[str, Any]:
    """The tensors ``spans`` describes, as views of ``buffers``: numpy
    arrays or torch tensors by ``framework`` (the public loaders' overloads
    say which; torch is optional, so it is not named here)."""
    if framework == "numpy":
        for name, dtype, _shape, i, _start, _end in spans:
            if dtype not in _NUMPY:
                err = UnsupportedDtypeError(
                    f"{buffers[i].path}: tensor {name!r} is {dtype}, which numpy "
                    "has no dtype for (safetensors.numpy raises TypeError too); "
                    "load it with framework='pt'"
                )
                err.path, err.tensor = str(buffers[i].path), name
                raise err
    flats = [np.asarray(b) for b in buffers]
    out: dict[str, Any] = {}
    if framework == "numpy":
        for name, dtype, shape, i, start, end in spans:
            out[name] = _view(flats[i], _NUMPY[dtype], shape, start, end)
        return out
    import torch

    for name, dtype, shape, i, start, end in spans:
        arr = _view(flats[i], _NUMPY.get(dtype) or _STAND_IN[dtype], shape, start, end)
        tensor = torch.from_numpy(arr)
        want = getattr(torch, _TORCH[dtype])
        out[name] = tensor if tensor.dtype == want else tensor.view(want)
    return out


def _view(
    flat: np.ndarray[Any, Any],
    dtype: np.dtype[Any],
    shape: Sequence[int],
    start: int,
    end: int,
) -> np.ndarray[Any, Any]:
    arr = flat[start:end].view(dtype).reshape(tuple(shape))
    if not arr.flags.aligned:
        arr = arr.copy()
    return arr


def _invalid(name: str, reason: str) -> InvalidTensorError:
    err = InvalidTensorError(f"invalid tensor {name!r}: {reason}")
    err.tensor = name
    return err


def to_arrays(tensors: Mapping[str, Any]) -> list[tuple[str, str, np.ndarray[Any, Any]]]:
    """``(name, safetensors dtype, C-contiguous little-endian ndarray)`` for
    every numpy array (or numpy scalar, as a 0-d array) or torch CPU tensor
    of ``tensors``, in order.

    Contiguous inputs are passed on as they are (no copy); others are copied
    into a contiguous array, as are big-endian numpy arrays (into little
    endian). torch dtypes numpy lacks are passed as same-size integer views.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to arrays, not {type(tensors).__name__}")
    torch = sys.modules.get("torch")
    out = []
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise _invalid(repr(name), f"names must be str, not {type(name).__name__}")
        if isinstance(value, np.ndarray | np.generic):
            dtype, arr = _from_numpy(name, np.asarray(value))
        elif torch is not None and isinstance(value, torch.Tensor):
            dtype, arr = _from_torch(name, value, torch)
        else:
            raise _invalid(name, f"expected a numpy.ndarray or a torch.Tensor, got {type(value).__name__}")
        out.append((name, dtype, arr))
    return out


def _from_numpy(name: str, arr: np.ndarray[Any, Any]) -> tuple[str, np.ndarray[Any, Any]]:
    dt = arr.dtype
    kind, size = dt.kind, dt.itemsize
    if kind == "b" and size == 1:
        dtype = "BOOL"
    elif kind in "iu" and size in (1, 2, 4, 8):
        dtype = f"{'I' if kind == 'i' else 'U'}{size * 8}"
    elif kind == "f" and size in (2, 4, 8):
        dtype = f"F{size * 8}"
    else:
        raise _invalid(name, f"numpy dtype {dt} has no safetensors dtype")
    if dt.byteorder == ">":
        arr = arr.astype(dt.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    return dtype, np.asarray(arr)


def _from_torch(name: str, t: Any, torch: Any) -> tuple[str, np.ndarray[Any, Any]]:
    # torch is optional: the module and its tensor arrive untyped, taken
    # from sys.modules only when the caller has imported torch.
    if t.device.type != "cpu":
        raise _invalid(name, f"it is on {t.device}; move it to the CPU first (tensor.cpu())")
    if t.layout != torch.strided or t.is_quantized:
        raise _invalid(name, f"only dense tensors can be saved, not {t.layout} ones")
    by_torch = {getattr(torch, v): k for k, v in _TORCH.items()}
    dtype = by_torch.get(t.dtype)
    if dtype is None:
        raise _invalid(name, f"torch dtype {t.dtype} has no safetensors dtype")
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if dtype in _STAND_IN:
        t = t.view(getattr(torch, "int16" if dtype == "BF16" else "uint8"))
    return dtype, t.numpy()
