"""A pinned host int32 that a CUDA stream waits on and any host thread sets (HKV_GRAMMAR_DEVICE_WAIT=1).

    host thread:  write the mask bytes ... flag = k         (a plain 4-byte store, no CUDA call)
    stream:       forward ... wait(flag >= k) -> copy masks -> apply -> sample

The wait is the driver's stream memory operation `cuStreamWaitValue32(stream, addr, value, flags)`
(cuda.h; exported as cuStreamWaitValue32_v2 since CUDA 11.7, the v1 symbol only where stream memory
operations are enabled: NVreg_EnableStreamMemOPs=1, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92),
called through ctypes on libcuda.so.1 with CU_STREAM_WAIT_VALUE_GEQ (0): the stream passes once
`(int32_t)(*addr - value) >= 0`, a cyclic comparison, so values may wrap past 2**32 as long as fewer
than 2**31 are outstanding. The v2 API has no capability attribute for 32-bit waits (only for 64-bit and
NOR ones), so `supported` enqueues one wait that is already satisfied and synchronizes: a driver
that cannot wait answers CUDA_ERROR_NOT_SUPPORTED there, at start-up, not in a served step.

The device pointer: torch's pinned tensors come from its caching host allocator (cudaHostAlloc with
cudaHostAllocDefault, or cudaHostRegister under `pinned_use_cuda_host_register`). Under UVA (every 64-bit
Linux process) cudaHostAlloc'd memory is mapped and its device address is its host address, but registered
memory keeps that identity only where CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM holds;
`cuMemHostGetDevicePointer` answers correctly for both, so the address comes from it.

Memory ordering (why a plain store is enough): the thread that sets the flag wrote the masks, or joined the
threads that did (their futures: a lock acquire, which orders their stores before what follows on ARMv8 too,
being multi-copy atomic); x86 keeps stores in program order (TSO), so the GPU cannot read the new flag
value before the mask bytes stored before it; and the copy engine reads the mask buffer only after the
stream passes the wait, i.e. after it saw the flag. Nothing here needs a fence on the device side either:
the masks travel by a stream-ordered copy, not by a kernel reading host memory it may have cached.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

CUDA_SUCCESS = 0
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92
MASK32 = 0xFFFFFFFF


class HostFlagError(RuntimeError):
    """A driver call of the flag failed: the message names it and its CUresult."""


@dataclass(frozen=True)
class Support:
    """Whether device-side waits work here, and if not why (`bool(support)` is `ok`)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


class _Driver:
    """The few libcuda entry points the flag needs, their C signatures declared for ctypes."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.versioned = hasattr(lib, "cuStreamWaitValue32_v2")
        if not self.versioned and not hasattr(lib, "cuStreamWaitValue32"):
            raise HostFlagError("libcuda.so.1 exports no cuStreamWaitValue32")
        # CUresult cuStreamWaitValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
        self.wait_value32 = lib.cuStreamWaitValue32_v2 if self.versioned else lib.cuStreamWaitValue32
        self.wait_value32.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.wait_value32.restype = ctypes.c_int
        # CUresult cuMemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int Flags), Flags = 0
        self.host_pointer = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or lib.cuMemHostGetDevicePointer
        self.host_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self.host_pointer.restype = ctypes.c_int
        # CUresult cuDeviceGet(CUdevice *device, int ordinal); cuDeviceGetAttribute(int *pi, attrib, CUdevice dev)
        self.device_get = lib.cuDeviceGet
        self.device_get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self.device_get.restype = ctypes.c_int
        self.attribute = lib.cuDeviceGetAttribute
        self.attribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.attribute.restype = ctypes.c_int

    def check(self, what: str, result: int) -> None:
        if result != CUDA_SUCCESS:
            raise HostFlagError(f"{what} failed: CUresult {result}")

    def device_attribute(self, ordinal: int, attribute: int) -> int:
        dev, value = ctypes.c_int(), ctypes.c_int()
        self.check("cuDeviceGet", self.device_get(ctypes.byref(dev), ordinal))
        self.check("cuDeviceGetAttribute", self.attribute(ctypes.byref(value), attribute, dev.value))
        return value.value


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _load() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


class HostFlag:
    """One pinned uint32 on `device`'s side: `wait(value)` queues a wait on the current stream, `set(value)`
    (any thread) lets every wait for a value cyclically <= it pass. Starts at 0."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._driver = _load()
        with torch.cuda.device(self.device):  # the device's primary context current on this thread
            torch.cuda.current_stream(self.device)
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # kept alive: the GPU reads it
            address = ctypes.c_uint64()
            self._driver.check("cuMemHostGetDevicePointer",
                               self._driver.host_pointer(ctypes.byref(address), self._host.data_ptr(), 0))
        self.device_ptr = address.value
        self._cell = ctypes.c_uint32.from_address(self._host.data_ptr())  # the plain store `set` does

    def wait(self, value: int, stream: torch.cuda.Stream | None = None) -> None:
        """Queue on `stream` (the device's current one) a wait until the flag reaches `value` (cyclically)."""
        stream = stream or torch.cuda.current_stream(self.device)
        self._driver.check("cuStreamWaitValue32", self._driver.wait_value32(
            ctypes.c_void_p(stream.cuda_stream), self.device_ptr, value & MASK32, CU_STREAM_WAIT_VALUE_GEQ))

    def set(self, value: int) -> None:
        """Store `value`: the device passes waits for it once it reads it (no CUDA call, any thread)."""
        self._cell.value = value & MASK32

    @property
    def value(self) -> int:
        return self._cell.value


def supported(device: torch.device | str) -> Support:
    """Whether this process can wait on a HostFlag on `device`: libcuda and its wait symbol load, stream memory
    operations are enabled (the v1 symbol alone needs CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1), and a wait
    that is already satisfied runs on a side stream."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return Support(False, f"{device} is not a CUDA device")
    try:
        driver = _load()
    except (OSError, AttributeError, HostFlagError) as exc:
        return Support(False, f"libcuda.so.1: {exc}")
    try:
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        if not driver.versioned and not driver.device_attribute(ordinal, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1):
            return Support(False, "only the v1 cuStreamWaitValue32, and stream memory operations are off "
                                  "(NVreg_EnableStreamMemOPs=0)")
        flag = HostFlag(device)
        side = torch.cuda.Stream(device)
        flag.wait(0, side)
        side.synchronize()
    except (HostFlagError, RuntimeError) as exc:
        return Support(False, str(exc))
    return Support(True, "cuStreamWaitValue32" + ("_v2" if driver.versioned else ""))


class FlagSequence:
    """Flag values for a stream's waits, handed out in the order the waits are queued, and the flag moved on only
    past values all released: a GEQ wait for k passes every earlier wait too, so releasing k before k - 1 (a launch
    that failed after queueing its wait, say) must not let k - 1's step read masks not yet written.

    `store` writes the flag (HostFlag.set; a list's append in tests). Thread-safe: values are taken on the rank's
    main thread and released on the mask fill's."""

    def __init__(self, store: Callable[[int], None]):
        self._store = store
        self._lock = threading.Lock()
        self._issued = 0  # the last value handed out
        self._passed = 0  # the flag's value: every value up to it released
        self._released: set[int] = set()  # released values past `_passed`

    def take(self) -> int:
        """The next value to wait for."""
        with self._lock:
            self._issued += 1
            return self._issued

    def release(self, value: int) -> None:
        """`value`'s masks are written (or never will be): the flag moves past it once all before it are."""
        with self._lock:
            if value <= self._passed or value > self._issued:
                return
            self._released.add(value)
            moved = self._passed
            while moved + 1 in self._released:
                moved += 1
                self._released.discard(moved)
            if moved != self._passed:
                self._passed = moved
                self._store(moved)

    def release_all(self) -> None:
        """Every wait queued so far passes (shutdown: the device must not wait forever)."""
        with self._lock:
            self._released.clear()
            if self._passed != self._issued:
                self._passed = self._issued
                self._store(self._issued)

    @property
    def outstanding(self) -> int:
        """Values handed out and not yet passed."""
        with self._lock:
            return self._issued - self._passed
