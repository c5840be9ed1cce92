"""Peak memory a call allocates on the CPU, from PyTorch's own allocator events.

``torch.profiler`` with ``profile_memory=True`` records every allocation and free of the CPU
allocator (a ``[memory]`` event carrying ``+bytes`` or ``-bytes``), temporaries inside
operators included. Their running sum in time order is the memory the call holds beyond what
existed before it; its maximum is the peak. A count of bytes, not a timing: the same on a
loaded machine.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak
