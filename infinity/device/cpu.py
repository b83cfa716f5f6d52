"""The CPU as the compute device: `CpuDevice`, and `AsyncTestDevice`, which behaves like an
asynchronous accelerator so that the CPU test suite checks the ordering a GPU needs."""

from __future__ import annotations

import queue
import random
import signal
import threading
import weakref

import torch

from infinity.device.base import HELD, Device, InFlight

GARBAGE = 0xFF  # every byte: NaN in fp32, bf16 and fp16


class CpuDevice(Device):
    """Host memory is device memory: a copy is done when it returns (the source itself, without
    a copy, when no destination is given: the caller copies it into its own buffer anyway)."""

    name = "cpu"

    def __init__(self) -> None:
        self.compute = torch.device("cpu")

    def to_device(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> InFlight:
        if dst is None:
            return InFlight(src, None, None)
        dst.copy_(src)
        return InFlight(dst, None, None)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> InFlight:
        dst.copy_(src)
        return InFlight(dst, None, None)

    def wait_compute(self, x: InFlight) -> torch.Tensor:
        return x.tensor

    def wait_host(self, x: InFlight) -> torch.Tensor:
        return x.tensor

    def done(self, x: InFlight) -> bool:
        return True


class _Copy:
    __slots__ = ("src", "dst", "landed", "reported", "lock")

    def __init__(self, src: torch.Tensor, dst: torch.Tensor):
        self.src, self.dst = src, dst
        self.landed = threading.Event()  # the bytes are in the destination
        self.reported = threading.Event()  # the host may know it (`done`): later than `landed`
        self.lock = threading.Lock()

    def land(self) -> None:
        """Performs the copy once, reading the source as it is now (whoever comes first)."""
        with self.lock:
            if not self.landed.is_set():
                self.dst.copy_(self.src)
                self.landed.set()


def _land_copies(copies: queue.Queue, rng: random.Random, max_delay_s: float, stopping: threading.Event) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)  # [Note: workers block signals] in csrc/aio/quiet_thread.h
    while (copy := copies.get()) is not None:
        stopping.wait(rng.uniform(0.0, max_delay_s))  # no more waiting once the device stops
        copy.land()
        copy.reported.set()


def _stop(copies: queue.Queue, thread: threading.Thread, stopping: threading.Event) -> None:
    stopping.set()
    copies.put(None)
    thread.join()


class AsyncTestDevice(Device):
    """The CPU behaving like an asynchronous device ([Note: in-flight copies]).

    A copy reads its source and writes its destination only when it lands: after a random
    delay of up to `max_delay_s`, on a background thread, or at the first wait for it. Until
    then the destination holds garbage (NaN bytes), and a change to the source is copied. So
    code that reads a destination early, or reuses a source early, computes with wrong values.
    `done` turns True only once the background thread or a host wait has seen the copy end,
    not after a compute wait: as on a GPU, where the compute stream waits and the host does not.
    Every pool buffer handed back is filled with garbage at once (`scribble`), so a copy still
    reading one that was returned too early copies garbage.
    """

    name = "async-test"

    def __init__(self, max_delay_s: float = 0.004, seed: int = 0) -> None:
        self.compute = torch.device("cpu")
        self.max_delay_s = max_delay_s
        self._random = random.Random(seed)
        self._queue: queue.Queue[_Copy | None] = queue.Queue()
        stopping = threading.Event()
        self._thread = threading.Thread(target=_land_copies, args=(self._queue, self._random, max_delay_s, stopping),
                                        name="infinity-async-test-device", daemon=True)
        self._thread.start()
        # Stopped before the interpreter tears torch down (at exit, or with the device): a
        # thread still copying tensors then would abort the process.
        weakref.finalize(self, _stop, self._queue, self._thread, stopping)

    def _issue(self, src: torch.Tensor, dst: torch.Tensor) -> InFlight:
        dst.view(torch.uint8).fill_(GARBAGE) if dst.is_contiguous() else dst.fill_(float("nan"))
        copy = _Copy(src, dst)
        self._queue.put(copy)
        return InFlight(dst, src, copy)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> InFlight:
        return self._issue(src, torch.empty_like(src) if dst is None else dst)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> InFlight:
        return self._issue(src, dst)

    def wait_compute(self, x: InFlight) -> torch.Tensor:
        # The compute stream is the host thread: the bytes must be there now. But, as on a GPU,
        # the host has not learnt that the copy is over: `done` stays False until it is told.
        if x.fence is not None:
            x.fence.land()
        return x.tensor

    def wait_host(self, x: InFlight) -> torch.Tensor:
        if x.fence is not None:
            x.fence.land()
            x.fence.reported.set()
        return x.tensor

    def done(self, x: InFlight) -> bool:
        return x.fence is None or x.fence.reported.is_set()

    def scribble(self, buffer: torch.Tensor) -> None:
        buffer.view(torch.uint8).fill_(GARBAGE)
