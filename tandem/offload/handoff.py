"""How a CUDA stream hands an offloaded layer's MoE call to the CPU and waits for it
(`--cpu-moe-handoff`). Both are stream operations, so a captured decode graph replays them:

* `hostfunc`: a host node (`cuLaunchHostFunc`). The driver's callback thread runs the kernel's C
  function. Each call pays the driver's wake-up of that thread and its signal back to the stream.
* `poll` (the doorbell): the stream writes the layer's job number into a pinned flag
  (`cuStreamWriteValue32`), a Tandem thread that polls the flag runs the call and writes the number
  into a second flag, and the stream waits for it (`cuStreamWaitValue32`), then clears it. The
  protocol is in moe_doorbell.cpp. The thread spins for 2 ms after each call, then naps 20 us
  between looks, so it holds a core only while layers are coming.

Either way the inputs and the output go through the same pinned staging buffers
(tandem/offload/cpu_executor.py).
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from tandem.offload import cpu_experts

HANDOFFS = ("hostfunc", "poll")
_CU_STREAM_WAIT_VALUE_EQ = 0x1
_DONE_WORD = 16  # moe_doorbell.cpp's kDoneWord


@functools.cache
def _driver() -> ctypes.CDLL:
    """libcuda (loaded by torch), with the functions used here typed."""
    lib = ctypes.CDLL("libcuda.so.1")
    p, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
    lib.cuLaunchHostFunc.argtypes, lib.cuLaunchHostFunc.restype = [p, p, p], ctypes.c_int
    for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [p, u64, u32, ctypes.c_uint], ctypes.c_int
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(u64), p, ctypes.c_uint]
    lib.cuMemHostGetDevicePointer_v2.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        hint = " (stream memory operations: try --cpu-moe-handoff hostfunc)" if "Value32" in what else ""
        raise RuntimeError(f"{what} failed with CUresult {rc}: the CPU experts cannot be queued on the stream{hint}")


def launch_host_func(stream: torch.cuda.Stream, fn_ptr: int, arg_ptr: int) -> None:
    """Queues the C function fn_ptr(arg_ptr) on the stream (a host node when captured)."""
    _check(_driver().cuLaunchHostFunc(stream.cuda_stream, fn_ptr, arg_ptr), "cuLaunchHostFunc")


def _close(lib: ctypes.CDLL, handle: int, *keep: object) -> None:
    lib.tandem_doorbell_close(handle)


class Doorbell:
    """The polling thread and its two pinned flags (module doc). `add(job)` registers a layer's
    HostJob and returns its number; `signal(stream, number)` queues the request on a stream and
    `wait(stream, number)` the wait and the clear. A CPU run can drive it by hand (`request`, `done`: tests)."""

    def __init__(self) -> None:
        self._lib = cpu_experts._lib()
        self.flags = torch.zeros(2 * _DONE_WORD, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        handle = self._lib.tandem_doorbell_open(self.flags.data_ptr())
        if not handle:
            raise RuntimeError("could not start the CPU experts' doorbell thread")
        self._handle = handle
        self._jobs: list[cpu_experts.HostJob] = []  # kept alive: the thread holds their structs
        # The finalizer holds what the thread reads, so none of it is freed before the thread stops.
        self._close = weakref.finalize(self, _close, self._lib, handle, self.flags, self._jobs)
        self._device_flags: int | None = None

    def add(self, job: cpu_experts.HostJob) -> int:
        number = self._lib.tandem_doorbell_add(self._handle, job.arg_ptr)
        if number < 0:
            raise RuntimeError("the CPU experts' doorbell holds 4096 jobs at most")
        self._jobs.append(job)
        return number

    @property
    def served(self) -> int:
        """Calls run since start."""
        return self._lib.tandem_doorbell_served(self._handle)

    def check(self) -> None:
        """Raises the first failure of a call run by the thread (a bad expert id or row count)."""
        job = ctypes.c_int32(-1)
        status = self._lib.tandem_doorbell_error(self._handle, ctypes.byref(job))
        if status == -1:
            raise RuntimeError(f"the CPU experts' doorbell got a request for job {job.value}, which does not exist")
        if status != 0:
            self._jobs[job.value].run()  # the same call again, synchronously: raises its error
            raise RuntimeError(f"CPU expert call {job.value} failed with status {status}")

    def close(self) -> None:
        """Stops the thread (nothing queued on a stream may still wait on it)."""
        self._close()

    # ---- the GPU side ----------------------------------------------------------------------------

    def _device_address(self) -> int:
        if self._device_flags is None:
            address = ctypes.c_uint64()
            _check(_driver().cuMemHostGetDevicePointer_v2(ctypes.byref(address), self.flags.data_ptr(), 0),
                   "cuMemHostGetDevicePointer")
            self._device_flags = address.value
        return self._device_flags

    def signal(self, stream: torch.cuda.Stream, number: int) -> None:
        """Queues on `stream` the request for job `number` (the thread starts it once the stream
        gets there). Work queued after it, before `wait`, runs on the GPU meanwhile."""
        _check(_driver().cuStreamWriteValue32_v2(stream.cuda_stream, self._device_address(), number + 1, 0),
               "cuStreamWriteValue32")

    def wait(self, stream: torch.cuda.Stream, number: int) -> None:
        """Queues on `stream` the wait for job `number` to be done, then the done flag's clearing."""
        drv, s = _driver(), stream.cuda_stream
        done = self._device_address() + 4 * _DONE_WORD
        _check(drv.cuStreamWaitValue32_v2(s, done, number + 1, _CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")
        _check(drv.cuStreamWriteValue32_v2(s, done, 0, 0), "cuStreamWriteValue32")

    # ---- by hand (a CPU run, tests) --------------------------------------------------------------

    def request(self, number: int) -> None:
        self.flags[_DONE_WORD] = 0
        self.flags[0] = number + 1

    def done(self) -> int:
        """The done flag: the last finished job's number + 1, 0 while none is."""
        return int(self.flags[_DONE_WORD])
