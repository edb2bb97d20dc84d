"""extkv: a growable KV-cache backing allocation on virtual memory.

Reserve address space for the largest KV cache once, commit physical memory for
a prefix of blocks on demand, and keep every address fixed, so tensor views and
captured CUDA graphs stay valid while the cache grows, shrinks, is defragmented
or is released for sleep and recommitted.
"""

from .errors import DriverError, ExtkvError, OutOfMemoryError, StateError
from .tensor import ExtensibleTensor, MappedChunk
from .usage import UsageProbe
from .vmm import Driver, FaultInjectingDriver, HostDriver, driver_for

__version__ = "0.1.0"

__all__ = [
    "Driver",
    "DriverError",
    "ExtensibleTensor",
    "ExtkvError",
    "FaultInjectingDriver",
    "HostDriver",
    "MappedChunk",
    "OutOfMemoryError",
    "StateError",
    "UsageProbe",
    "driver_for",
]
