"""glibc's allocator on CPU runs: fixed thresholds instead of drifting ones.

By default glibc starts at a 128 KiB mmap threshold and raises it after each large free,
trimming the heap whenever twice that is free at its top. A training step frees and re-makes the
same buffers every step (gradients, optimizer temporaries), so with those defaults many of them
are unmapped and page-faulted in again each step, while larger transient buffers end up in the
heap and stay resident. The thresholds are therefore fixed, by ZeRO stage:

* ZeRO-0: buffers below 16 MiB stay in the heap for reuse (a small model's step is much faster),
  larger ones get their own mapping and go back to the OS when freed.
* ZeRO 1-3: from 256 KiB. ZeRO gathers each layer's weights into a fresh buffer of a few MiB in
  forward and backward, makes full-size gradients, bucket copies and gloo's temporaries of them,
  and frees them again, while activations made in between stay until backward: in the heap they
  pin the holes those buffers leave, so the heap only grows and the memory ZeRO saves stays
  resident. Own mappings give it back, for more page faults per step (the docs' Performance
  section has the measured memory and time).

Any MALLOC_*_ variable the user set wins (glibc then uses theirs).
"""

from __future__ import annotations

import ctypes
import os
import sys

HOST_MMAP_THRESHOLD = 16 << 20  # ZeRO-0: buffers this large get their own mapping, unmapped when freed
HOST_MMAP_THRESHOLD_SHARDED = 256 << 10  # the same under ZeRO 1-3
HOST_TRIM_THRESHOLD = 32 << 20  # free memory kept at the top of the heap for the next step


def tune_host_allocator(on_gpu: bool = False, sharded: bool = False) -> bool:
    """Fix glibc's thresholds for a CPU run (`sharded`: ZeRO 1-3; see the module doc). Returns
    True when the settings were applied (not on a GPU run, not with the user's own MALLOC_*_)."""
    if on_gpu or not sys.platform.startswith("linux"):
        return False
    if any(key.startswith("MALLOC_") and key.endswith("_") for key in os.environ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        threshold = HOST_MMAP_THRESHOLD_SHARDED if sharded else HOST_MMAP_THRESHOLD
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(
            libc.mallopt(m_trim_threshold, HOST_TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):  # not glibc
        return False
