"""The activation tier: where the inputs an activation checkpoint keeps live between its forward
and its recompute (on the compute device, in page-locked host memory, or on NVMe), and how they
move there and back. The checkpoint itself (what it keeps, the recompute, DeepSpeed's API) is
infinity/deepspeed/checkpointing.py ([Note: what a checkpoint keeps] there); `initialize`
hands this tier the engine's device and the config's section (`attach`).

[Note: checkpointed inputs in host memory]
With `cpu_checkpointing`, each floating-point tensor argument on the compute device is copied,
after the forward, into a page-locked host buffer through the device layer ([Note: in-flight
copies] in infinity.device: `to_host` on the copy-out stream, after the compute issued so far).
The checkpoint holds the device tensor only until the copy is reported done (polled at each
later checkpoint and before a recompute), so its memory goes back as soon as nothing else holds
it. The copy back (`to_device`, copy-in stream) of a checkpoint's inputs is issued when the
recompute of the checkpoint after it in forward order starts, so it runs under that checkpoint's
backward; the recompute waits for it on the compute stream. A dense tensor keeps its strides.
Host buffers come from a stash that keeps them from one step to the next (page-locking memory in
the middle of a step would stall it); `reset()` frees the idle ones. On a host whose compute
device is the CPU, host memory is device memory: there is nothing to move, the arguments are
kept as they are, and the log says so once. Tensors on another device than the compute device,
and integer tensors (token ids), are kept as they are, as DeepSpeed keeps them.

[Note: checkpointed inputs on NVMe]
infinity's own keys `activation_checkpointing.nvme_path` and `nvme_min_bytes`: a checkpoint whose
floating-point inputs (the activations, not parameters or token ids) take at least
`nvme_min_bytes` writes them to a file of its own under `nvme_path` and lets them go, so that a
long sequence's hidden states between checkpointed layers cost disk, not host (or device)
memory. After the forward the inputs are copied into one page-locked host buffer (`to_host`, as
for cpu_checkpointing; on the CPU a plain copy); once the copies are reported done the buffer is
written through the aio handle (O_DIRECT) and the inputs are dropped; once the write is reported
done, at a later checkpoint, the buffer goes back to the stash. At most `_WRITES_IN_FLIGHT`
writes run at once: a forward faster than the disk waits for the oldest, so the host memory of
the spill stays bounded by those buffers. In backward the read of a checkpoint's inputs is issued
when the recompute of the checkpoint after it in forward order starts (as the copy back of
[Note: checkpointed inputs in host memory] is), so it runs under that checkpoint's backward; the
recompute waits for it, then copies to the device (on the CPU it computes from the buffer
itself), and the buffer stays with the checkpoint until the checkpoint is gone. A checkpoint
whose backward comes before its write was issued or finished keeps its buffer and reads nothing.
`Where` names each stage and the memory it holds. Files are allocated once, reused by size and
overwritten in place, in a directory claimed and cleaned like a store's (`NvmeDirectory`,
`<nvme_path>/infinity-<job>-activations/rank<r>/`: removed once the checkpointing state is reset
and its checkpoints are gone, at exit, or on a fatal signal; found and removed by the next run
when the process was killed outright). The bytes read back are the bytes written: the gradients
are torch's checkpoint's bit for bit. It applies with or without cpu_checkpointing, and on the
CPU too, where cpu_checkpointing has nothing to move.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from infinity.config.sections import ActivationCheckpointingConfig
from infinity.device import Device, InFlight, make_device
from infinity.device.timeline import TIMELINE
from infinity.io import PAGE_SIZE, AsyncIOHandle, aligned_empty
from infinity.offload.store import NvmeDirectory, default_job_id

log = logging.getLogger("infinity")

_ALIGN = 64  # bytes between two inputs in one host buffer: any dtype's view starts aligned
_WRITES_IN_FLIGHT = 2  # spilled checkpoints whose buffer is being written ([Note: checkpointed inputs on NVMe])


# ---- host buffers ([Note: checkpointed inputs in host memory]) ----------------------------------


class _HostStash:
    """Page-locked host buffers for checkpointed inputs, kept from one step to the next: one free
    list per size, or, with `slots`, one arena of `slots` equal slots sized by the first request."""

    def __init__(self, device: Device, slots: int | None):
        self.device = device
        self.slots = slots
        self._free: dict[int, list[torch.Tensor]] = {}  # capacity -> idle buffers (1-D uint8, page-locked)
        self._arena: torch.Tensor | None = None  # slots x slot_bytes, 1-D uint8, page-locked
        self._slot_bytes = 0
        self._idle_slots: list[int] = []

    def take(self, nbytes: int) -> torch.Tensor:
        capacity = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
        if self.slots is not None:
            return self._take_slot(nbytes, capacity)
        idle = self._free.get(capacity)
        return idle.pop() if idle else aligned_empty(capacity)

    def _take_slot(self, nbytes: int, capacity: int) -> torch.Tensor:
        if self._arena is None:
            self._slot_bytes = capacity
            self._arena = aligned_empty(capacity * self.slots)
            self._idle_slots = list(range(self.slots - 1, -1, -1))
        if nbytes > self._slot_bytes:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization: a checkpoint's inputs take "
                             f"{nbytes} bytes, more than the {self._slot_bytes}-byte slot the first checkpoint sized; "
                             "checkpoints must be alike (or turn it off)")
        if not self._idle_slots:
            raise RuntimeError(f"activation_checkpointing.number_checkpoints: more than {self.slots} checkpoints hold "
                               "host copies at once; raise number_checkpoints to the checkpoints of one forward")
        slot = self._idle_slots.pop()
        return self._arena[slot * self._slot_bytes:(slot + 1) * self._slot_bytes]

    def give(self, buf: torch.Tensor) -> None:
        self.device.scribble(buf)  # the test device: a copy still reading it would read garbage
        if self._arena is not None and buf.data_ptr() - self._arena.data_ptr() in range(self._arena.numel()):
            self._idle_slots.append((buf.data_ptr() - self._arena.data_ptr()) // self._slot_bytes)
        else:
            self._free.setdefault(buf.numel(), []).append(buf)

    def clear(self) -> None:
        """Frees the idle buffers (those in use come back to a stash nobody uses, and go)."""
        self._free.clear()


# ---- one checkpoint ([Note: what a checkpoint keeps]) --------------------------------------------


class _Kept:
    """One tensor argument of a checkpoint, from its forward to its recompute."""

    __slots__ = ("tensor", "version", "requires_grad", "activation", "host", "copy_out", "copy_in")

    def __init__(self, tensor: torch.Tensor):
        self.tensor: torch.Tensor | None = tensor.detach()  # on its device; None once its host copy is done
        self.version = version(tensor)  # a later in-place change is caught, not recomputed from
        self.requires_grad = tensor.requires_grad
        # a parameter passed as an argument is the model's, not an activation: never copied out
        self.activation = tensor.is_floating_point() and not isinstance(tensor, torch.nn.Parameter)
        self.host: torch.Tensor | None = None  # page-locked copy (cpu_checkpointing)
        self.copy_out: InFlight | None = None  # device -> host, until reported done
        # host -> device, issued ahead of the recompute; after it, the fence alone (the host buffer
        # is not reused before a host wait on it, [Note: in-flight copies])
        self.copy_in: InFlight | None = None


def version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (None for an inference tensor, which has none)."""
    return None if t.is_inference() else t._version


class _Lease:
    """A checkpoint's host buffer: back to the stash once the checkpoint is gone and no copy
    reads or writes it any more."""

    def __init__(self, stash: _HostStash, device: Device, buf: torch.Tensor, kept: list[_Kept]):
        self.stash, self.device, self.buf, self.kept = stash, device, buf, kept

    def close(self) -> None:
        for k in self.kept:
            for copy in (k.copy_out, k.copy_in):
                if copy is not None and not self.device.done(copy):
                    self.device.wait_host(copy)
            k.copy_out = k.copy_in = k.tensor = k.host = None
        self.stash.give(self.buf)


# ---- inputs on NVMe ([Note: checkpointed inputs on NVMe]) --------------------------------------


class _SpillFiles:
    """One file per spilled checkpoint in a claimed directory on NVMe, reused by capacity."""

    def __init__(self, nvme_path: os.PathLike, rank: int):
        self.place = NvmeDirectory(nvme_path, job_id=f"{default_job_id()}-activations", rank=rank,
                                   key="activation_checkpointing.nvme_path")
        self.handle = AsyncIOHandle()
        self._free: dict[int, list[str]] = {}  # capacity -> idle files
        self._made = 0

    def take(self, capacity: int) -> str:
        idle = self._free.get(capacity)
        if idle:
            return idle.pop()
        path = os.path.join(self.place.directory, f"inputs{self._made}.bin")
        self._made += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, capacity)  # allocated once, overwritten in place from then on
        except OSError as e:
            os.unlink(path)
            raise OSError(e.errno, f"activation_checkpointing.nvme_path: cannot allocate {capacity} bytes for "
                                   f"{path}: {e.strerror}", path) from None
        finally:
            os.close(fd)
        return path

    def give(self, path: str, capacity: int) -> None:
        self._free.setdefault(capacity, []).append(path)


class Where(enum.Enum):
    """Where a spilled checkpoint's inputs are, and the memory the checkpoint holds meanwhile."""

    COPYING = "copies into the host buffer in flight: holds the buffer and the inputs"
    WRITING = "the buffer's write to the file in flight: holds the buffer"
    ON_DISK = "in the file only: holds no memory"
    READING = "the file's read into a buffer in flight: holds the buffer"
    BACK = "in the host buffer again, for the recompute: holds it until the checkpoint is gone"


class _Spill:
    """A checkpoint's inputs on their way to NVMe and back; its steps never block except `back`."""

    def __init__(self, files: _SpillFiles, stash: _HostStash, device: Device, kept: list[_Kept], offsets: list[int],
                 capacity: int):
        self.files, self.stash, self.device = files, stash, device
        self.kept = kept
        self.views = [(offset, k.tensor.shape, k.tensor.stride(), k.tensor.dtype, _is_dense(k.tensor))
                      for k, offset in zip(kept, offsets)]
        self.capacity = capacity  # bytes moved, a multiple of PAGE_SIZE (O_DIRECT)
        self.path = files.take(capacity)
        self.buf: torch.Tensor | None = stash.take(capacity)  # 1-D uint8, page-locked
        self.request: int | None = None  # the write or read in flight
        self._show()
        for k in kept:
            k.copy_out = device.to_host(k.tensor, k.host)
        self.where = Where.COPYING

    def _show(self) -> None:
        """Each input's view of the buffer, with its shape and strides."""
        for k, (offset, shape, stride, dtype, dense) in zip(self.kept, self.views):
            flat = self.buf[offset:offset + _numel(shape) * dtype.itemsize].view(dtype)
            k.host = flat.as_strided(shape, stride) if dense else flat.view(shape)

    def advance(self) -> None:
        """The write once the copies are reported done; the buffer back once the write is."""
        if self.where is Where.COPYING and all(self.device.done(k.copy_out) for k in self.kept):
            for k in self.kept:
                _drop_source(k)
            self.request = self.files.handle.submit_write(self.buf[:self.capacity], self.path)
            self.where = Where.WRITING
        if self.where is Where.WRITING and self.files.handle.done(self.request):
            self.finish_write()

    def finish_write(self) -> None:
        assert self.where is Where.WRITING
        self.files.handle.wait(self.request)
        self.request = None
        self._let_buffer_go()
        self.where = Where.ON_DISK

    def fetch(self) -> None:
        """Issues the read of the inputs, when they are on disk only."""
        if self.where is not Where.ON_DISK:
            return
        self.buf = self.stash.take(self.capacity)
        self._show()
        self.request = self.files.handle.submit_read(self.buf[:self.capacity], self.path)
        self.where = Where.READING

    def back(self) -> None:
        """Blocks until the inputs are in the host buffer (`k.host`)."""
        if self.where is Where.COPYING:
            for k in self.kept:
                self.device.wait_host(k.copy_out)
                _drop_source(k)
        elif self.where is Where.WRITING:
            self.files.handle.wait(self.request)  # the buffer still holds the inputs: nothing to read
            self.request = None
        self.fetch()
        if self.where is Where.READING:
            with TIMELINE.span("checkpoint_inputs_read", "wait"):
                self.files.handle.wait(self.request)
            self.request = None
        self.where = Where.BACK

    def _let_buffer_go(self) -> None:
        for k in self.kept:
            k.host = None
        self.stash.give(self.buf)
        self.buf = None

    def close(self) -> None:
        """The checkpoint is gone: its buffer and file go back, once nothing reads or writes them."""
        for k in self.kept:
            for copy in (k.copy_out, k.copy_in):
                if copy is not None and not self.device.done(copy):
                    self.device.wait_host(copy)
            k.copy_out = k.copy_in = k.tensor = None
        if self.request is not None:
            try:
                self.files.handle.wait(self.request)
            except OSError:
                pass  # nobody needs these bytes any more; the file is overwritten by its next use
        if self.buf is not None:
            self._let_buffer_go()
        self.files.give(self.path, self.capacity)


def _numel(shape: torch.Size) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _packed(movable: list[_Kept]) -> tuple[list[int], int]:
    """Each input's offset in one host buffer, and the bytes they take together."""
    offsets, total = [], 0
    for k in movable:
        offsets.append(total)
        total += -(-k.tensor.numel() * k.tensor.element_size() // _ALIGN) * _ALIGN
    return offsets, total


def _movable(frame: Frame) -> list[_Kept]:
    """The frame's inputs that are activations on the compute device (what may leave it)."""
    device = frame.device
    return [k for k in frame.kept if k.activation and k.tensor.device == device.compute and k.tensor.numel()]


def spill(frame: Frame, state: ActivationState) -> bool:
    """Sends the frame's inputs to NVMe when they are large enough; whether it did."""
    cfg = state.config
    movable = _movable(frame)
    offsets, total = _packed(movable)
    if cfg.nvme_path is None or not movable or total < cfg.nvme_min_bytes:
        return False
    writing = [f.spill for f in (ref() for ref in state.copying_out)
               if f is not None and f.spill is not None and f.spill.where is Where.WRITING]
    for spill in writing[:max(0, len(writing) - _WRITES_IN_FLIGHT + 1)]:  # the disk is behind: wait for it
        with TIMELINE.span("checkpoint_inputs_write", "wait"):
            spill.finish_write()
    capacity = -(-total // PAGE_SIZE) * PAGE_SIZE
    frame.spill = _Spill(state.files, state.stash, frame.device, movable, offsets, capacity)
    weakref.finalize(frame, frame.spill.close)
    frame.spill.advance()
    state.copying_out.append(weakref.ref(frame))
    return True


class _Marker:
    """Where a tensor argument sits in a checkpoint's args and kwargs."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class Frame:
    """One call of `checkpoint`: what its recompute needs, and the tensors it caught."""

    __slots__ = ("function", "device", "args", "kwargs", "kept", "rng", "autocast", "num_saved", "recomputed",
                 "offloaded", "spill", "__weakref__")

    def __init__(self, function: Callable, args: tuple, kwargs: dict, device: Device):
        self.function = function
        self.device = device  # its copies' device, whatever configure() does before its recompute
        self.kept: list[_Kept] = []
        self.args = tuple(self._mark(a) for a in args)
        self.kwargs = {k: self._mark(v) for k, v in kwargs.items()}
        self.rng = (torch.get_rng_state(), device.rng_state())
        self.autocast = _autocast_state(device.compute.type)
        self.num_saved = 0  # tensors autograd saved in the forward (and dropped)
        self.recomputed: dict[int, torch.Tensor] | None = None  # caught by the recompute, until handed out
        self.offloaded = False  # the arguments went to host memory
        self.spill: _Spill | None = None  # the arguments went to NVMe

    def _mark(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        self.kept.append(_Kept(value))
        return _Marker(len(self.kept) - 1)

    def pack(self, tensor: torch.Tensor) -> tuple["Frame", int]:
        self.num_saved += 1
        return self, self.num_saved - 1

    def check_unchanged(self, args: tuple, kwargs: dict) -> None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        for i, (k, t) in enumerate(zip(self.kept, tensors)):
            if version(t) != k.version:
                raise RuntimeError(f"checkpoint: the function changed its tensor argument {i} in place; its recompute "
                                   "would start from the changed values (clone the argument first)")

    def fill(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        put = lambda v: tensors[v.index] if isinstance(v, _Marker) else v  # noqa: E731
        return tuple(put(a) for a in self.args), {k: put(v) for k, v in self.kwargs.items()}


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    kinds = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds]


class ActivationState:
    """The process's checkpointing settings, device, host stash, spill files and live checkpoints
    (DeepSpeed's are globals too): `STATE`, replaced whole by tests."""

    def __init__(self) -> None:
        self.config = ActivationCheckpointingConfig()
        self.configured = False
        self._device: Device | None = None
        self.attached: Device | None = None  # the latest engine's device (`attach`), else make_device()'s
        self._stash: _HostStash | None = None
        self._files: _SpillFiles | None = None
        self.frames: list[weakref.ref[Frame]] = []  # forward order: who prefetches whom
        self.copying_out: list[weakref.ref[Frame]] = []  # frames whose copies to the host may run
        self.said_nothing_to_move = False

    @property
    def device(self) -> Device:
        if self._device is None:
            self._device = self.attached if self.attached is not None else make_device()
        return self._device

    @property
    def stash(self) -> _HostStash:
        if self._stash is None:
            cfg = self.config
            slots = cfg.number_checkpoints if cfg.contiguous_memory_optimization else None
            self._stash = _HostStash(self.device, slots)
        return self._stash

    @property
    def files(self) -> _SpillFiles:
        if self._files is None:
            self._files = _SpillFiles(self.config.nvme_path, _rank())
        return self._files

    def moves_to_host(self) -> bool:
        """Whether checkpointed inputs go to host memory ([Note: checkpointed inputs in host memory])."""
        if not self.config.cpu_checkpointing:
            return False
        if self.device.name == "cpu":
            if not self.said_nothing_to_move:
                self.said_nothing_to_move = True
                log.info("infinity.checkpointing: cpu_checkpointing: the compute device is the CPU, so checkpointed "
                         "inputs are in host memory already; nothing is moved")
            return False
        return True

    def forget(self) -> None:
        if self._stash is not None:
            self._stash.clear()
        self._stash = None
        self._files = None  # its directory goes once the checkpoints that still use it are gone
        self._device = None
        self.frames.clear()
        self.copying_out.clear()


STATE = ActivationState()


STATE = ActivationState()


def configure_state(config: ActivationCheckpointingConfig) -> None:
    """New settings: what the state held for the old ones is forgotten first."""
    STATE.forget()
    STATE.config = config
    STATE.configured = True
    log.info("infinity.checkpointing: %s", ", ".join(f"{f.name}={getattr(config, f.name)}"
                                                     for f in dataclasses.fields(config)))


def attach(device: Device, section: ActivationCheckpointingConfig | None = None) -> None:
    """What `infinity.initialize` hands over: the engine's device, which checkpoints use from now
    on, and its config's `activation_checkpointing` section, when it has one, which configures
    this module as `configure(deepspeed_config=...)` would (None leaves the settings as they are)."""
    if section is not None:
        configure_state(section)
    if STATE.attached is not device:
        STATE.forget()  # the next checkpoint takes it
        STATE.attached = device


def _rank() -> int:
    """This process's rank: each rank spills into a directory of its own."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---- copies ([Note: checkpointed inputs in host memory]) ----------------------------------------


def _is_dense(t: torch.Tensor) -> bool:
    """Whether `t` covers exactly numel elements of its storage in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def offload(frame: Frame, state: ActivationState) -> None:
    """Issues the copies of the frame's floating-point device arguments into one host buffer."""
    device = frame.device
    movable = _movable(frame)
    if not movable:
        return
    offsets, total = _packed(movable)
    buf = state.stash.take(total)
    weakref.finalize(frame, _Lease(state.stash, device, buf, movable).close)
    for k, offset in zip(movable, offsets):
        t = k.tensor
        flat = buf[offset:offset + t.numel() * t.element_size()].view(t.dtype)
        k.host = flat.as_strided(t.shape, t.stride()) if _is_dense(t) else flat.view(t.shape)
        k.copy_out = device.to_host(t, k.host)
    frame.offloaded = True
    state.copying_out.append(weakref.ref(frame))


def settle(state: ActivationState) -> None:
    """Drops the device tensors whose copies to the host are reported done (their memory goes back
    once nothing else holds it), oldest first, and forgets checkpoints that are gone."""
    pending = []
    for ref in state.copying_out:
        frame = ref()
        if frame is None:
            continue
        if frame.spill is not None:
            frame.spill.advance()
            if frame.spill.where in (Where.COPYING, Where.WRITING):
                pending.append(ref)
            continue
        for k in frame.kept:
            if k.copy_out is not None and frame.device.done(k.copy_out):
                _drop_source(k)
        if any(k.copy_out is not None for k in frame.kept):
            pending.append(ref)
    state.copying_out = pending
    state.frames = [ref for ref in state.frames if ref() is not None]


def _drop_source(k: _Kept) -> None:
    if version(k.tensor) != k.version:
        raise RuntimeError("checkpoint: a tensor argument of a checkpoint was changed in place after the checkpoint, "
                           "while its copy to host memory ran; the recompute cannot tell which values it copied")
    k.copy_out = None
    k.tensor = None


def prefetch(frame: Frame, state: ActivationState) -> None:
    """Issues the copies back of the arguments of the checkpoint before `frame` in forward order
    (backward recomputes it next), so that they run under `frame`'s backward."""
    live = [f for f in (ref() for ref in state.frames) if f is not None]
    if frame not in live:
        return
    for earlier in reversed(live[:live.index(frame)]):
        if earlier.recomputed is None:
            if earlier.spill is not None:
                earlier.spill.fetch()
            elif earlier.offloaded:
                _copy_in(earlier, earlier.device)
            return


def _copy_in(frame: Frame, device: Device) -> None:
    for k in frame.kept:
        if k.host is None or (k.copy_in is not None and k.copy_in.source is not None):
            continue
        if k.copy_out is not None:  # long done by now; the host must know before it reads the buffer
            device.wait_host(k.copy_out)
            _drop_source(k)
        # the CPU computes from the host copy itself (CpuDevice hands the source back)
        dst = None if device.name == "cpu" else torch.empty_strided(k.host.shape, k.host.stride(), dtype=k.host.dtype,
                                                                    device=device.compute)
        k.copy_in = device.to_device(k.host, dst)


def restore(frame: Frame, device: Device) -> list[torch.Tensor]:
    """The frame's tensor arguments on the compute device, as they were at its forward."""
    if frame.spill is not None:
        frame.spill.back()
    _copy_in(frame, device)
    out = []
    with TIMELINE.span("checkpoint_inputs", "wait"):
        for i, k in enumerate(frame.kept):
            if k.copy_in is not None:
                t = device.wait_compute(k.copy_in)
            else:
                if version(k.tensor) != k.version:
                    raise RuntimeError(f"checkpoint: tensor argument {i} of a checkpoint was changed in place between "
                                       "its forward and its recompute; the recompute would use the changed values")
                t = k.tensor
            out.append(t.detach().requires_grad_(k.requires_grad))
    return out


