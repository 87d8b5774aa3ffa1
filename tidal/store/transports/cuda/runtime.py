"""The CUDA runtime calls the store makes, through ``ctypes`` to the ``libcudart`` that torch
loaded (no extension is compiled), and raw device memory seen as tensors: slot allocation,
IPC handles and their opening (tidal/store/transports/cuda/ipc.py), and the tensors over an
opened slot that zero-copy reads return (:func:`alias`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from tidal.store import ops
from tidal.store.errors import StoreError

HANDLE_BYTES = ops.HANDLE_BYTES
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class _Runtime:
    """The few CUDA runtime functions the store needs, from torch's own libcudart."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        c_int, vp = ctypes.c_int, ctypes.c_void_p
        self._malloc = _fn(lib, "cudaMalloc", [ctypes.POINTER(vp), ctypes.c_size_t])
        self._free = _fn(lib, "cudaFree", [vp])
        self._get = _fn(lib, "cudaIpcGetMemHandle", [ctypes.POINTER(_IpcHandle), vp])
        self._open = _fn(
            lib, "cudaIpcOpenMemHandle", [ctypes.POINTER(vp), _IpcHandle, ctypes.c_uint]
        )
        self._close = _fn(lib, "cudaIpcCloseMemHandle", [vp])
        self._memcpy = _fn(lib, "cudaMemcpyAsync", [vp, vp, ctypes.c_size_t, c_int, vp])
        self._error = lib.cudaGetErrorString
        self._error.restype, self._error.argtypes = ctypes.c_char_p, [c_int]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self._error(rc).decode(errors="replace")
            raise StoreError(f"CUDA error in {what}: {msg} ({rc})")

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self.check(self._malloc(ctypes.byref(ptr), nbytes), f"cudaMalloc({nbytes})")
        assert ptr.value is not None, "cudaMalloc returned no pointer"
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check(self._free(ctypes.c_void_p(ptr)), "cudaFree")

    def handle(self, ptr: int) -> bytes:
        h = _IpcHandle()
        self.check(self._get(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), HANDLE_BYTES)

    def open(self, handle: bytes) -> int:
        if len(handle) != HANDLE_BYTES:
            raise StoreError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
        h = _IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_void_p()
        rc = self._open(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS)
        self.check(rc, "cudaIpcOpenMemHandle")
        assert ptr.value is not None, "cudaIpcOpenMemHandle returned no pointer"
        return ptr.value

    def close(self, ptr: int) -> None:
        self.check(self._close(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")

    def memcpy_async(self, pairs: list[tuple[int, int, int]], stream: int) -> None:
        """``cudaMemcpyAsync`` of each (dst, src, nbytes) on ``stream``, device to device."""
        f, check = self._memcpy, self.check
        for dst, src, n in pairs:
            rc = f(dst, src, n, _MEMCPY_DEVICE_TO_DEVICE, stream)
            if rc:
                check(rc, f"cudaMemcpyAsync({n} bytes)")


def _fn(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
    f = getattr(lib, name)
    f.restype, f.argtypes = ctypes.c_int, argtypes
    return f


@functools.cache
def runtime() -> _Runtime:
    """The CUDA runtime torch uses (found among this process's mapped libraries once CUDA
    is initialized). Raises StoreError without CUDA."""
    if not torch.cuda.is_available():
        raise StoreError("CUDA IPC needs a CUDA device; none is available in this process")
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        paths = {ln.split()[-1] for ln in f if "/libcudart" in ln and ".so" in ln}
    if not paths:
        raise StoreError(
            "CUDA IPC: torch has not loaded libcudart in this process (a torch build with a "
            "statically linked CUDA runtime is not supported)"
        )
    return _Runtime(sorted(paths)[0])


class _DeviceMemory:
    """Raw device memory seen by torch through ``__cuda_array_interface__``. The tensor's
    storage holds this object until it is freed, and with it ``keep``."""

    __slots__ = ("__cuda_array_interface__", "keep")

    def __init__(self, ptr: int, nbytes: int, keep: object) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }
        self.keep = keep


def as_tensor(ptr: int, nbytes: int, device: int, keep: object = None) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of device memory at ``ptr`` (no copy). Its
    storage, shared by every view of it, holds ``keep`` alive until it is freed."""
    t = torch.as_tensor(_DeviceMemory(ptr, nbytes, keep), device=f"cuda:{device}")
    if t.data_ptr() != ptr:
        raise StoreError("torch copied device memory it was asked to alias (as_tensor)")
    return t


def device_uuid(index: int) -> str:
    """A GPU's identity across processes (device indices depend on CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """This process's index of the GPU ``uuid``; StoreError if it is not visible here."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise StoreError(
        f"the writer's GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES); "
        "CUDA IPC reads need it"
    )
