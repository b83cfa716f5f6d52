"""Page-locking host memory through the CUDA driver, for the buffers infinity.io allocates
([Note: page-locking is the device layer's] in infinity/io/memory.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CudaHostRegistration:
    """cudaHostRegister / cudaHostUnregister, when a GPU is present ([Note: pinned buffer
    lifetime] in infinity/io/memory.py: the pages are unregistered before they are freed)."""

    def present(self) -> bool:
        return torch.cuda.is_available()

    def register(self, ptr: int, nbytes: int) -> Callable[[], None]:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")

        def unregister() -> None:  # runs in the buffer's destructor, possibly while Python shuts down
            try:
                cudart.cudaHostUnregister(ptr)
            except Exception:  # the process is ending: its memory goes with it
                pass

        return unregister
