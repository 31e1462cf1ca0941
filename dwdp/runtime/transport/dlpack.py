"""A torch tensor over memory this process mapped itself, on the device the caller names: a DLPack
capsule built by hand, so torch never asks the pointer where it lives.

Why not `torch.as_tensor(obj_with___cuda_array_interface__, device=d)`: torch asks
cudaPointerGetAttributes for the pointer's device and, for memory that lives on another GPU (a peer's
segment mapped into this process), copies all of it to `d`. `torch.from_dlpack` takes the device
from the capsule's DLDevice (kDLCUDA, id) and wraps the pointer as it is. The tensor does not own the
memory: it is valid until the caller unmaps it.

Legend: n = bytes.
"""
from __future__ import annotations

import ctypes
import threading

import torch

# DLPack's C structs (dlpack.h, the unversioned "dltensor" capsule every torch release reads).
_KDL_CPU, _KDL_CUDA = 1, 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# The capsule's destructor gets the dying capsule as a raw pointer (no reference taken to an object whose
# count is already zero); these read it without touching its count.
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Each capsule's structs stay alive until torch frees its tensor and calls the deleter.
_alive: dict[int, tuple] = {}
_alive_lock = threading.Lock()


def _delete(managed) -> None:
    with _alive_lock:
        _alive.pop(ctypes.addressof(managed.contents), None)


_deleter = _DELETER(_delete)


def _capsule_destructor(capsule: int) -> None:
    """A capsule torch never consumed (still named "dltensor": a consumer renames it "used_dltensor") frees
    its structs itself, as dlpack.h asks of a producer."""
    if _PyCapsule_IsValid(capsule, b"dltensor"):
        address = _PyCapsule_GetPointer(capsule, b"dltensor")
        with _alive_lock:
            _alive.pop(address, None)


_destructor = _CAPSULE_DESTRUCTOR(_capsule_destructor)


class _Bytes:
    """`nbytes` at `ptr` on (device_type, device_id), for torch.from_dlpack."""

    def __init__(self, ptr: int, nbytes: int, device_type: int, device_id: int):
        self.ptr, self.nbytes, self.device = ptr, nbytes, (device_type, device_id)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, stream=None, **_kwargs):
        # The stream needs no ordering here: the caller synchronises the memory it maps.
        shape = (ctypes.c_int64 * 1)(self.nbytes)
        strides = (ctypes.c_int64 * 1)(1)  # dlpack.h: strides "can not be NULL if ndim != 0" (newer releases)
        managed = _DLManagedTensor()
        managed.dl_tensor.data = self.ptr
        managed.dl_tensor.device = _DLDevice(*self.device)
        managed.dl_tensor.ndim = 1
        managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
        managed.dl_tensor.shape = shape
        managed.dl_tensor.strides = strides
        managed.dl_tensor.byte_offset = 0
        managed.deleter = _deleter
        with _alive_lock:
            _alive[ctypes.addressof(managed)] = (managed, shape, strides)
        return _PyCapsule_New(ctypes.addressof(managed), b"dltensor", ctypes.cast(_destructor, ctypes.c_void_p))


def tensor_over(ptr: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
    """uint8 [nbytes] over the memory at `ptr`, on `device` exactly (cuda:i or cpu), never a copy:
    ValueError if torch would hand back other memory."""
    device = torch.device(device)
    if nbytes < 1:
        raise ValueError(f"tensor_over(ptr={ptr:#x}, nbytes={nbytes}): nbytes must be >= 1")
    if device.type == "cuda":
        want = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        where = (_KDL_CUDA, want.index)
    elif device.type == "cpu":
        want, where = torch.device("cpu"), (_KDL_CPU, 0)
    else:
        raise ValueError(f"tensor_over: device {device} is not 'cuda' or 'cpu'")
    tensor = torch.from_dlpack(_Bytes(ptr, nbytes, *where))
    if tensor.data_ptr() != ptr or tensor.device != want:
        raise ValueError(f"tensor_over: torch gave {tensor.device} memory at {tensor.data_ptr():#x} for {nbytes} "
                         f"bytes at {ptr:#x} on {want}: a copy, not a view of the mapping")
    return tensor
