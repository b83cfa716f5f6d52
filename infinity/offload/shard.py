"""`Shard`: one shard as the swapper sees it, and the transfers in flight on it.

[Note: shard life cycle]
Each shard the swapper has seen has one record (`Shard`) whose `ShardState` changes only
through `to_*()` methods that assert the states they may leave:

    EMPTY, NVME, INVALID --write, evict------------------------------> HOST_TO_NVME
    NVME --fetch----------------------------------------------------> NVME_TO_HOST
    NVME_TO_HOST --read done: HOST; read failed: NVME
    HOST --last release of changed bytes, or write to a cached shard--> HOST_TO_NVME
    HOST --last release, and the cache does not keep it-------------> NVME
    HOST_TO_NVME --done: HOST if held or cached, else NVME; failed: INVALID

A HOST shard is held by its fetchers (`holders`) or, once the last one released it, kept by the
host cache; a HOST shard that is neither goes back to NVME and its buffer to the pool at once.
Changed bytes are written when the last holder releases them (write-through, so that evicting a
cached shard never waits for a write and the optimizer's writes start while it updates the next
unit); the buffer stays with the shard until the write is waited for.

The record holds no lock and does no I/O: the swapper changes it with its lock held, and decides
when each transition happens ([Note: transfer ordering] in swapper.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from infinity.offload.state import ShardState
from infinity.offload.store import Extent

ShardKey = tuple[str, Hashable]  # (kind, key): how the swapper and its cache name a shard


class Transfer(NamedTuple):
    """An NVMe transfer in flight and the memory it uses: `buffer` is neither read, changed nor
    reused before `request` was waited for."""

    buffer: torch.Tensor  # 1-D uint8: the bytes moved (whole pages of a pool buffer, or the caller's tensor)
    request: int  # the I/O handle's request id
    write: bool
    started: float  # time.monotonic() at submission


class FetchHandle(NamedTuple):
    """A fetch: `Swapper.wait` turns it into the shard's bytes once `transfer` has completed."""

    kind: str
    key: Hashable
    transfer: Transfer | None  # what the shard was waiting on at fetch time; None: already in host memory


class WriteHandle(NamedTuple):
    """A write to NVMe: `Swapper.wait` returns once it has completed, raising if it failed."""

    kind: str
    key: Hashable
    transfer: Transfer


@dataclass(slots=True, eq=False)
class Shard:
    """One shard as the swapper sees it ([Note: shard life cycle])."""

    kind: str
    key: Hashable
    extent: Extent
    state: ShardState = ShardState.EMPTY
    buffer: torch.Tensor | None = None  # 1-D uint8 pool buffer, whole pages: NVME_TO_HOST, HOST, HOST_TO_NVME
    transfer: Transfer | None = None  # in flight: NVME_TO_HOST, HOST_TO_NVME
    holders: int = 0  # fetches not yet released
    dirty: bool = False  # HOST: changed by a holder; written when the last holder releases it
    completing: bool = False  # a thread is waiting on `transfer` ([Note: completing transfers] in transfers.py)
    lent: int = 0  # HOST_TO_NVME: holders handed the bytes before the write ended ([Note: lending bytes under a write])
    failure: tuple[Transfer | None, OSError] | None = None  # last failed transfer (None: at submission), and why

    @property
    def lendable(self) -> bool:
        """Held, with its newest bytes in a pool buffer that a write is still reading
        ([Note: lending bytes under a write] in swapper.py)."""
        return self.state is ShardState.HOST_TO_NVME and self.buffer is not None and self.holders > 0

    @property
    def name(self) -> str:
        return f"shard {self.key!r} of kind {self.kind!r}"

    def _leave(self, *allowed: ShardState) -> None:
        assert self.state in allowed, f"{self.name}: {self.state.name} -> expected one of {[s.name for s in allowed]}"

    def to_nvme_to_host(self, buffer: torch.Tensor, transfer: Transfer) -> None:
        self._leave(ShardState.NVME)
        self.state, self.buffer, self.transfer = ShardState.NVME_TO_HOST, buffer, transfer

    def to_host_to_nvme(self, transfer: Transfer, buffer: torch.Tensor | None) -> None:
        """Starts a write; `buffer` is the pool buffer it writes from (None: the caller's tensor)."""
        if self.state is ShardState.HOST:
            assert buffer is self.buffer and not self.dirty and self.holders == 0
        else:
            self._leave(ShardState.EMPTY, ShardState.NVME, ShardState.INVALID)
        self.state, self.buffer, self.transfer = ShardState.HOST_TO_NVME, buffer, transfer

    def to_host(self) -> None:
        """A read completed, or a write completed and its buffer stays with the shard."""
        self._leave(ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME)
        assert self.buffer is not None
        self.state, self.transfer, self.lent = ShardState.HOST, None, 0

    def to_nvme(self) -> torch.Tensor | None:
        """The bytes are (still) only on NVMe; returns the buffer to give back, if any."""
        if self.state is ShardState.HOST:
            assert self.holders == 0 and not self.dirty, f"{self.name} is in use or changed"
        else:
            self._leave(ShardState.NVME_TO_HOST, ShardState.HOST_TO_NVME)
        buffer = self.buffer
        self.state, self.buffer, self.transfer = ShardState.NVME, None, None
        return buffer

    def to_invalid(self) -> torch.Tensor | None:
        """A write failed (or could not even be submitted); returns its buffer to give back, if any."""
        if self.state is ShardState.HOST:
            assert self.holders == 0, f"{self.name} is in use"
        else:
            self._leave(ShardState.HOST_TO_NVME, ShardState.EMPTY, ShardState.NVME, ShardState.INVALID)
        buffer = self.buffer
        self.state, self.buffer, self.transfer, self.dirty = ShardState.INVALID, None, None, False
        return buffer
