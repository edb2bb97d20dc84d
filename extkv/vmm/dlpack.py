"""Non-owning uint8 tensors over raw addresses, built through DLPack.

Why DLPack and not `__cuda_array_interface__` or `torch.frombuffer`: torch
rejects an array-interface pointer whose first byte has nothing mapped yet
("pointer resides on host memory"), but accepts a DLPack capsule over the same
unmapped reservation with the right `data_ptr`. Using one path for the host and
CUDA keeps the views identical in behaviour.

Why libc `free` as the deleter: the views must survive interpreter teardown. A
Python (ctypes) deleter may run after the interpreter is gone and crash; `free`
needs nothing. So the whole DLManagedTensor, with its shape and strides, lives in
one malloc'd block and the deleter frees exactly that block. The memory the view
points at is never owned by the view: the ExtensibleTensor owns it.
"""

from __future__ import annotations

import ctypes

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_FREE_ADDRESS = ctypes.cast(_libc.free, ctypes.c_void_p).value

_DL_CPU = 1
_DL_CUDA = 2
_DL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _ManagedBlock(ctypes.Structure):
    """The one malloc'd block: the managed tensor followed by shape and strides."""

    _fields_ = [("managed", _DLManagedTensor), ("shape", ctypes.c_int64), ("stride", ctypes.c_int64)]


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def uint8_view(address: int, size: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor of `size` bytes at `address`, owning nothing."""
    if device.type == "cpu":
        device_type, device_id = _DL_CPU, 0
    elif device.type == "cuda":
        device_type, device_id = _DL_CUDA, device.index if device.index is not None else 0
    else:
        raise ValueError(f"uint8_view supports cpu and cuda devices, got {device}")
    block_address = _libc.malloc(ctypes.sizeof(_ManagedBlock))
    if not block_address:
        raise MemoryError("malloc failed for a DLPack tensor descriptor")
    block = _ManagedBlock.from_address(block_address)
    block.shape = size
    block.stride = 1
    tensor = block.managed.dl_tensor
    tensor.data = address
    tensor.device = _DLDevice(device_type, device_id)
    tensor.ndim = 1
    tensor.dtype = _DLDataType(_DL_UINT, 8, 1)
    tensor.shape = block_address + _ManagedBlock.shape.offset
    tensor.strides = block_address + _ManagedBlock.stride.offset
    tensor.byte_offset = 0
    block.managed.manager_ctx = None
    block.managed.deleter = _FREE_ADDRESS
    # No capsule destructor: torch consumes the capsule at once and from then
    # on owns the block through the deleter.
    capsule = _PyCapsule_New(block_address, b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)
