"""One tensor's bytes in a file of a local disk (memory.offload_disk_dir): the host offloader's disk tier.

The file is created with `tempfile.mkstemp` in the given directory and unlinked at once, so only the open file
descriptor names it: its space returns to the file system when the `DiskFile` is closed, or when the process
ends, however it ends. Reads and writes are `os.pwrite` / `os.preadv` on the tensor's own memory (a CPU tensor,
contiguous: the caller stages a CUDA tensor through pinned host memory), in pieces of at most 1 GiB (Linux moves at
most 2 GiB - 4 KiB per call).
"""

from __future__ import annotations

import os
import tempfile

import torch

PIECE = 1 << 30


def _raw(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor, as a writable numpy uint8 view of its memory."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"a disk copy needs a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
    return t.reshape(-1).view(torch.uint8).numpy()


class DiskFile:
    """An unlinked file holding one tensor's bytes; `close()` (or dropping it) gives the space back."""

    def __init__(self, directory: str) -> None:
        fd, path = tempfile.mkstemp(prefix="upipe-offload-", dir=directory)
        os.unlink(path)  # nameless from now on: nothing is left behind if the job dies
        self.fd: int | None = fd
        self.nbytes = 0

    def write(self, t: torch.Tensor) -> None:
        """The bytes of CPU tensor t, from offset 0."""
        raw = _raw(t)
        done = 0
        while done < raw.nbytes:
            done += os.pwrite(self.fd, raw[done:done + PIECE], done)
        self.nbytes = raw.nbytes

    def read_into(self, t: torch.Tensor) -> None:
        """Fill CPU tensor t (as many bytes as were written) from the file."""
        raw = _raw(t)
        if raw.nbytes != self.nbytes:
            raise ValueError(f"reading {raw.nbytes} bytes from a disk copy of {self.nbytes}")
        done = 0
        while done < raw.nbytes:
            n = os.preadv(self.fd, [raw[done:done + PIECE]], done)
            if n <= 0:
                raise EOFError(f"disk copy ended at byte {done} of {raw.nbytes}")
            done += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()
