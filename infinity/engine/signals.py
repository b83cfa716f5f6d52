"""Signal handlers of the user's run at step boundaries.

[Note: signals at step boundaries]
A preemption handler (`signal.signal(SIGTERM, save_and_exit)`) runs in the main thread between
two bytecodes, wherever that thread is: in the middle of a step, some units updated and some
not, or after the backward that updated half the units ([Note: update during backward]). A
checkpoint saved there would not be a state the run ever passed through. So while a training
step is under way (from the forward that starts an accumulation to the `step()` that ends it),
and while a checkpoint is saved or loaded, the engine holds the user's handlers of the signals
schedulers send for preemption: a signal that arrives is noted, and its handler is called once
nothing holds any more, with every counter and every tier at a step boundary.
`engine.save_checkpoint` from that handler saves a state that resumes exactly.

One gate serves the whole process: two engines whose steps interleave (a policy and a reward
model) hold it together, and the handlers run only when neither is inside a step. With several
ranks a signal reaches each rank at a slightly different moment, and a handler that saves must
run at the same boundary everywhere (the save is collective): there the handlers stay held
between steps too, and at every step's end the ranks agree on the signals any of them received
(one small all-reduce) and all run those handlers.

Only Python handlers the user installed are held. The default disposition (die), an ignored
signal, Python's own KeyboardInterrupt, and the tiers' cleanup handler ([Note: cleanup on exit]
in infinity/offload/store.py), which kills the process anyway, act at once. Handlers can only be
changed from the main thread; elsewhere nothing is held. A handler installed while the gate
holds is taken as the user's new one at the next hold.

[Note: where a held handler may run]
CPython runs a Python handler in the main thread, at the first bytecode after the signal
arrived, and `signal.signal()` itself first runs the handlers of signals that are pending. So a
hold starts before the engine changes anything: a handler that was pending when a step begins
runs at `hold()`, with the engine still between steps, and after `hold()` every signal is only
noted. While held handlers are delivered, our note-taker stays in front of them: a second
signal during a handler (one that is saving a checkpoint) is noted and its handler runs after
the first returns, as POSIX delivers a signal that arrived during its own handler, instead of
entering the handler again in the middle of its save. A signal is only seen by the main thread
at once if the kernel hands it to that thread: the I/O engine's workers (csrc/aio) and our
other threads block the held signals, so that a main thread asleep in a system call is woken.

[Note: signals during cleanup]
`engine.close()` removes the NVMe stores, the only copy of the masters and moments. A signal
arriving in the middle, whatever its disposition (a user's handler, Python's KeyboardInterrupt,
the default that kills), would leave half of them behind or raise out of the removal. So inside
`deferred_signals()` every held signal that is not ignored is noted, and once the block is done
each acts as it would have: the handler is called, KeyboardInterrupt raised, the default
disposition kills the process.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from infinity.device.base import HELD  # the signals our other threads block, too


def _holdable(handler: object) -> bool:
    return (callable(handler) and handler is not signal.default_int_handler
            and not getattr(handler, "infinity_immediate", False))


class _Gate:
    """The process's one gate: counts holders, remembers the user's handlers, notes signals."""

    def __init__(self) -> None:
        self.holders = 0
        self.handlers: dict[int, Callable] = {}  # signal -> the user's handler, while ours is installed
        self.arrived: set[int] = set()
        self.delivering = False

    def note(self, signum: int, frame: object) -> None:
        self.arrived.add(signum)

    def install(self) -> None:
        """Puts `note` in front of every holdable handler (a new one of the user's included)."""
        for signum in HELD:
            handler = signal.getsignal(signum)
            if handler != self.note and _holdable(handler):
                self.handlers[signum] = handler
                signal.signal(signum, self.note)

    def restore(self) -> None:
        for signum, handler in self.handlers.items():
            if signal.getsignal(signum) == self.note:
                signal.signal(signum, handler)
        self.handlers = {}

    def deliver(self, agree: Callable[[set[int]], set[int]] | None, keep: bool) -> None:
        """Runs the handlers of the signals that arrived (all ranks' with `agree`), and of those
        that arrive while they run ([Note: where a held handler may run]); `keep`: our
        note-taker stays in front of them afterwards."""
        handlers = dict(self.handlers)
        self.delivering = True
        try:
            while True:  # with `agree`, every rank loops as often: each round's set is agreed
                arrived, self.arrived = self.arrived, set()
                if agree is not None:
                    arrived = agree(arrived)
                if not arrived:
                    break
                for signum in sorted(arrived):
                    if signum in handlers:
                        handlers[signum](signum, sys._getframe(2))  # noqa: SLF001 (the frame a handler is given)
        finally:
            self.delivering = False
            if not keep:
                self.restore()
        if not keep:  # arrived between the last round and the restore
            late, self.arrived = self.arrived, set()
            for signum in sorted(late):
                if signum in handlers:
                    handlers[signum](signum, sys._getframe(1))  # noqa: SLF001


_GATE = _Gate()


class SignalGate:
    """One engine's share of the process's gate: `hold()` until `release()`, counted, so that a
    save inside a step or a handler's save inside `release()` nests."""

    def __init__(self, agree: Callable[[set[int]], set[int]] | None = None) -> None:
        self._depth = 0
        self._agree = agree  # ranks > 1: all ranks' signals ([Note: signals at step boundaries])

    @property
    def holding(self) -> bool:
        return self._depth > 0

    def hold(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self._depth == 0:
            _GATE.holders += 1
        self._depth += 1
        try:
            _GATE.install()  # may run a pending handler first ([Note: where a held handler may run])
        except BaseException:  # that handler raised: this hold never began
            self._depth -= 1
            if self._depth == 0:
                _GATE.holders -= 1
                if _GATE.holders == 0 and not _GATE.delivering:  # nothing left noted behind the handlers
                    _GATE.deliver(None, keep=False)
            raise

    def release(self, boundary: bool = True) -> None:
        """Ends one hold; at the last one of the process (and not inside a handler) the held
        signals' handlers run, also after a failed step (`boundary` False: the step was
        abandoned, and the engine is between steps again). With ranks > 1 `release` at a
        boundary is collective: every rank calls it at the same point, and handlers stay held
        between steps and after a failure on one rank."""
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        _GATE.holders -= 1
        if _GATE.holders or _GATE.delivering:
            return
        if self._agree is not None and not boundary:
            return  # ranks run handlers together, at the end of a step that every rank reached
        _GATE.deliver(self._agree, keep=self._agree is not None)

    def close(self) -> None:
        """The engine is gone: its holds end, and with no other holder the user's handlers are back."""
        if self._depth:
            self._depth = 0
            _GATE.holders -= 1
        if _GATE.holders == 0 and not _GATE.delivering:
            _GATE.deliver(None, keep=False)


@contextlib.contextmanager
def deferred_signals() -> Iterator[list[int]]:
    """Every held signal that arrives inside the block acts when it ends, whatever its
    disposition ([Note: signals during cleanup]); the block is given the list of those that
    arrived so far. In the main thread only."""
    arrived: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return
    saved: dict[int, object] = {}
    try:
        for signum in HELD:  # a handler pending now runs here, before anything is removed
            handler = signal.getsignal(signum)
            if handler is signal.SIG_IGN or handler is None:
                continue
            saved[signum] = handler
            signal.signal(signum, lambda signum, frame: arrived.append(signum))
        yield arrived
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            handler = saved[signum]
            if handler == _GATE.note:  # the gate holds it: its handler runs when the gate lets go
                _GATE.arrived.add(signum)
            elif handler is signal.SIG_DFL:
                signal.raise_signal(signum)
            else:
                handler(signum, sys._getframe(1))  # noqa: SLF001 (the frame a handler is given)
