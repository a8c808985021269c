"""CPU buffers a kernel keeps between calls and hands out again once nothing else holds them.

glibc maps a block above its largest mmap threshold (32 MiB) afresh at every allocation and
the kernel zeroes each page at first touch; a caching allocator (CUDA's, NPU's) does not, so
this is for the CPU only. One [1024, 32 000] fp32 matmul output, 2-core Xeon without AMX
(``.diag/logits_buf.py``): 76 ms on fresh pages, 53 ms on kept ones. What is kept is what a
step needs anyway (a caching allocator's block), at most ``slots`` per dtype, each at most
twice the size asked for::

    pool = KeptBuffers(slots=2)       # two: the caller's previous output may still be alive
    out = pool.take((1024, 32000), torch.float32, torch.device("cpu"))
    pool.clear()                      # freed with their last holders

A buffer is handed out again only when its storage has no holder but the pool
(``torch._C._storage_Use_Count``): a tensor the caller still holds, a view of it, or a graph
that saved it is never overwritten.
"""
from __future__ import annotations

import math
import threading

import torch

MMAP_CEILING = 32 << 20  # glibc's largest adaptive mmap threshold (64-bit): above it, always mapped


def can_keep(device: torch.device) -> bool:
    """Whether a kernel's buffer on ``device`` is one to keep here: the CPU (a caching
    allocator reuses memory elsewhere), outside torch.compile and any trace with fake tensors
    (the buffer is the compiler's to plan; AOTAutograd tracing a graph handed to it directly,
    as the regional compile hands them, runs under a fake mode but not under Dynamo), and a
    torch that tells a storage's holders (so reuse is safe to decide)."""
    return device.type == "cpu" and not torch.compiler.is_compiling() and not _fake_mode() \
        and hasattr(torch._C, "_storage_Use_Count")


def _fake_mode() -> bool:
    """Whether a fake-tensor mode is on the dispatch stack (a compiler is tracing)."""
    keys = getattr(torch._C, "_TorchDispatchModeKey", None)
    return keys is not None and torch._C._get_dispatch_mode(keys.FAKE) is not None


class KeptBuffers:
    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        # (dtype, device) -> [(buffer, its storage's uses when only the pool holds it)], oldest first
        self.buffers: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, int]]] = {}
        self.lock = threading.Lock()

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``shape``: a kept one nothing else holds, else
        a new one, kept in place of the oldest when all ``slots`` are taken (that one is freed
        with its last holder)."""
        n, key = math.prod(shape), (dtype, torch.device(device))
        with self.lock:
            kept = self.buffers.setdefault(key, [])
            for i, (buf, idle) in enumerate(kept):
                if n <= buf.numel() <= 2 * n and _storage_uses(buf) <= idle:
                    kept.append(kept.pop(i))  # the most recently handed out last
                    return _on(buf, shape)
            buf = torch.empty(n, dtype=dtype, device=device)
            if len(kept) >= self.slots:
                kept.pop(0)
            kept.append((buf, _storage_uses(buf)))
            return _on(buf, shape)

    def clear(self) -> None:
        with self.lock:
            self.buffers.clear()


def _on(buf: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A contiguous ``shape`` tensor on ``buf``'s storage that is not a view of it (autograd
    lets a custom Function's caller modify such an output in place)."""
    return torch.empty((0,), dtype=buf.dtype, device=buf.device).set_(buf.untyped_storage(), 0, tuple(shape))


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
