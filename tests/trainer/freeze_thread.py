"""Freeze one thread of another process, leaving its other threads running: `python -m tests.trainer.freeze_thread TID`.

A worker whose training thread is frozen is a hung peer that still looks alive: TensorFlow's C++ threads keep
answering the coordination service's heartbeats, so only the launcher's hang watchdog can end its group. SIGSTOP
cannot do this (it stops every thread). ptrace can: PTRACE_SEIZE + PTRACE_INTERRUPT stop exactly the thread `TID`.
Prints "frozen" once it holds the thread, then waits until that thread's process ends (signals sent to it stay
undelivered while it is held, so SIGKILL ends it); exits with 77 and the reason when ptrace is not permitted.
"""

from __future__ import annotations

import ctypes
import os
import sys

PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
WAIT_ALL = 0x40000000  # __WALL: wait for threads as well as processes
EXIT_NOT_PERMITTED = 77


def main(tid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    for name, request in (("PTRACE_SEIZE", PTRACE_SEIZE), ("PTRACE_INTERRUPT", PTRACE_INTERRUPT)):
        if libc.ptrace(request, tid, None, None) != 0:
            print(f"cannot freeze thread {tid}: {name}: {os.strerror(ctypes.get_errno())}", flush=True)
            return EXIT_NOT_PERMITTED
    print("frozen", flush=True)
    while True:
        _, status = os.waitpid(tid, WAIT_ALL)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
