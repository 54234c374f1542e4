"""Tie a process's life to its parent's.

torchrun starts each worker in a session of its own, so killing torchrun (or the campaign
that launched it) leaves the workers running on a device whose lease is then reclaimed and
given to another trial. PR_SET_PDEATHSIG makes the kernel signal a child when its parent
dies, which closes that gap at both levels: campaign -> torchrun -> workers.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux only)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux: nothing to do
        return
    libc.prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)
