"""The one poll-with-backoff of every wait (:func:`wait_until`), and waits on a semaphore."""

from __future__ import annotations

import os
import time

import posix_ipc

__all__ = []

#: Seconds a wait polls, yielding the core at each turn, before it sleeps.
SPIN = 1e-3
#: Shortest and longest sleep between polls once the spin is over (seconds).
FIRST_SLEEP = 50e-6
MAX_SLEEP = 2e-3
#: Seconds between two runs of a wait's check.
CHECK_EVERY = 0.05


def wait_until(ready, check=None, *, timeout: float | None = None, spin: float = SPIN,
               check_every: float = CHECK_EVERY, first_sleep: float = FIRST_SLEEP,
               max_sleep: float = MAX_SLEEP, block=None, clock_every: int = 1) -> bool:
    """Wait until ``ready()``; True then, False once ``timeout`` seconds passed.

    Polls for ``spin`` seconds, yielding the core at each turn (the process
    waited for may need it); then sleeps between polls, ``first_sleep``
    doubling up to ``max_sleep``, or calls ``block()`` (a blocking wait of
    one slice, True once ready). ``check()`` runs every ``check_every``
    seconds and raises to end the wait; ``clock_every=n``: the spin reads the
    clock at every n-th turn only."""
    if ready():
        return True
    clock = time.perf_counter
    start = clock()
    next_check = start + check_every
    end = None if timeout is None else start + timeout
    sleep = first_sleep
    turns, mask = 0, clock_every - 1  # a power of two: the clock at every clock_every-th turn
    while True:
        os.sched_yield()
        if ready():
            return True
        turns += 1
        if turns & mask:
            continue
        now = clock()
        if now - start < spin:
            if check is not None and now >= next_check:
                next_check = now + check_every
                check()
            continue
        while True:  # the spin is over: sleep or block between polls
            if check is not None and now >= next_check:
                next_check = now + check_every
                check()
            if end is not None and now >= end:
                return False
            if block is not None:
                if block():
                    return True
            else:
                time.sleep(sleep if end is None else max(0.0, min(sleep, end - now)))
                sleep = min(sleep * 2, max_sleep)
                if ready():
                    return True
            now = clock()


def take(sem) -> bool:
    """Take a token of the POSIX semaphore ``sem`` if one is there now."""
    try:
        sem.acquire(0)
        return True
    except posix_ipc.BusyError:
        return False


def block_on(sem, seconds: float):
    """``block`` for :func:`wait_until`: up to ``seconds`` for a token of ``sem`` (a
    signal that interrupts it counts as a slice without one)."""
    def block() -> bool:
        try:
            sem.acquire(seconds)
            return True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False

    return block


