"""How a process hands freed host memory back to the OS (glibc's malloc).

glibc serves an allocation at or above its mmap threshold with a mapping of its own,
returned to the OS when freed, and smaller ones from a heap that keeps what was freed for
reuse. The threshold starts at 128 KiB and rises after the first large free (up to
32 MiB), after which buffers that come and go -- a server's per-round sum and weights
message, an FSDP rank's all-gathered layers -- are carved from the heap and their pages
stay resident when freed: a process's memory creeps far above what is live. Fixing the
threshold stops that. Too low a threshold costs speed where a process frees and
allocates many medium buffers (a CPU training step's activations: each gets a mapping of
its own, which the kernel must zero, where the heap would have reused freed memory), so
each process kind picks its own.
"""

from __future__ import annotations

SERVER_THRESHOLD = 128 << 10  # a server allocates few, large buffers per round
FSDP_RANK_THRESHOLD = 4 << 20  # above a step's activations, below a layer's all-gather


def fix_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of ``nbytes`` or more with their own mappings, for good (the
    dynamic adjustment off). False where the C library is not glibc (nothing done)."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
