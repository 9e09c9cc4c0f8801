"""The master's handle on a running fork: run a command in every process and
wait for the answers, with liveness checks, timeouts, Ctrl-C and close()
from another thread handled between wait slices."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from .. import _state
from .._procs import signals
from .._procs.children import Children
from .control import Command
from ..errors import (Aborted, PeerFailed, SynkError, SynkTimeoutError, WorkerDiedError, as_interrupt,
                      is_own_share_failure, unpack_exception)

__all__ = ["Session", "note_updates"]

log = logging.getLogger("synkhronos")

#: Seconds between the warnings logged while the master waits for workers that
#: have not answered a command (module constant: a test may shorten it).
WAIT_WARNING_INTERVAL = 60.0
#: Seconds the workers get to come back after a command was abandoned (Ctrl-C,
#: a timeout, close() from another thread) before the master raises all the same.
INTERRUPT_GRACE = 1.0
#: How often the master repeats its interrupt signal to workers still busy.
_RESIGNAL_EVERY = 0.2
#: Seconds between two liveness checks of a master that runs kept plans directly
#: (:meth:`Session.check_alive`). Each check waits on the workers' pids, which
#: releases the GIL; released more often than Python's switch interval (5 ms),
#: the GIL never reached another thread of the master: in a loop of small
#: collectives on 3 processes, a ``threading.Timer`` of 5 ms fired after up to 30 s
#: and a thread sleeping 1 ms at a time ran 0 to 10 times in 3 s (300 and more
#: with this value; ``tests/test_small_collectives.py``). Twice the switch interval.
ALIVE_EVERY = 0.01


class Session:
    """The master's handle on a running fork."""

    def __init__(self, proc, pids: dict[int, int], thread_limit, close: Callable[[], None], threads: int = 1):
        self.proc = proc
        self.kept = proc.kept        # the master's kept records (_kept/records.py; the same object as proc.kept)
        self._close = close          # runtime.close: a close() asked for during a command runs as it ends
        self.watch = Children(pids)         # the workers: reap, signal, end
        self.thread_limit = thread_limit
        self.threads = threads       # the master's thread cap while forked (limit_threads)
        self.freed = False           # inside synk.master_free(): the cap and binding lifted
        self.broken: BaseException | None = None
        self.distributed: set[int] = set()  # ids of functions the workers hold
        self.shared_ids: dict[int, int] = {}  # id(shared variable) -> sid
        self.shared_vars: dict[int, Any] = {}  # sid -> shared variable (keeps them alive)
        self.dropped: list[int] = []  # Data uids whose old mappings workers should close
        self.saved_affinity: set[int] | None = None  # the master's cores before fork() pinned it
        self.collective_scratch: dict[tuple, Any] = {}  # staging Data for values the master sends
        self.data_memory: dict[int, Any] = {}  # Data uid -> its shared memory, while the Data lives
        self.in_flight: int | None = None  # thread id while a command runs (nested calls are refused)
        self.alone = False  # in a step of the master's own (step_alone): the workers are idle
        self.pid = os.getpid()       # the process that called fork(): the only one that may use it
        self.timeout: float | None = None  # fork(timeout=...): longest wait for the workers
        self.close_requested = False  # close() came during a command (another thread, a handler)
        self.closed = False
        self.saved_handlers: dict[int, Any] = {}  # signal -> the disposition fork() replaced in the master
        self._needs_reset = False    # the abort flag was raised: reset before the next command
        self._wait_start = 0.0
        self._next_warning = 0.0
        self._next_signal = 0.0
        self._next_alive = 0.0       # check_alive(): when the workers' liveness is checked next
        self.on_step: Callable[[Command, Any], None] | None = None  # across nodes: starts each command's step
        self.on_break: Callable[[BaseException], None] | None = None  # across nodes: tells the others this fork broke

    @property
    def n_parallel(self) -> int:
        return self.proc.size

    def poll(self) -> None:
        """Between wait slices: raise WorkerDiedError (and mark the fork broken)
        if a worker has died, stop the command when it ran out of time or
        close() was called meanwhile, and warn when a wait lasts long."""
        self._watch_children()
        if self.close_requested:
            raise _CloseRequested()
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + WAIT_WARNING_INTERVAL
            log.warning("synkhronos: waited %.0f s for worker ranks %s to finish the command "
                        "(busy or stuck); fork(timeout=...) bounds the wait, Ctrl-C abandons it",
                        now - self._wait_start, self.proc.control.pending())
        if self.timeout is not None and now - self._wait_start > self.timeout:
            comm = self.proc.comm  # across nodes: waiting for the others?
            raise _TimedOut(self.proc.control.pending(), None if comm is None else comm.waiting_among_nodes())

    def check(self) -> None:
        """Master-side check between wait slices inside a collective (in a step of the
        master's own the workers are idle: a failure flag is the last command's, told already)."""
        self.poll()
        if not self.alone and self.proc.control.any_failed():
            # a worker failed outside a collective's own error protocol: free the others
            self.abort()
            raise Aborted("a worker failed during a collective")

    def abort(self) -> None:
        """Tell the workers to give up the running command (read between their wait slices)."""
        self.proc.control.set_abort(True)
        self._needs_reset = True

    def begin_wait(self) -> None:
        """A wait for the workers (or the other nodes) starts now: its timeout and
        slow-wait warnings count from here."""
        self._wait_start = time.monotonic()
        self._next_warning = self._wait_start + WAIT_WARNING_INTERVAL

    def interrupt_workers(self, now: float | None = None) -> None:
        """Send the interrupt signal to the workers that have not answered, so
        that a long computation stops at its next Python step."""
        now = time.monotonic() if now is None else now
        self._next_signal = now + _RESIGNAL_EVERY
        self.watch.signal(signals.INTERRUPT_SIGNAL, self.proc.control.pending())

    def _poll_abandoned(self, grace_end: float) -> None:
        """The check while waiting for workers to leave an abandoned command."""
        try:
            self.watch.poll()
        except WorkerDiedError as err:
            self.broken = err
            raise
        now = time.monotonic()
        if now >= self._next_signal:
            self.interrupt_workers(now)
        if now >= grace_end:
            raise _GraceOver()

    def _poll_settling(self) -> None:
        """The check while a new command first waits for workers still busy with an abandoned one."""
        self.poll()
        now = time.monotonic()
        if now >= self._next_signal:
            self.interrupt_workers(now)

    def _reset_after_abort(self) -> None:
        """Every worker answered: zero the communicator's semaphores and lower the abort flag."""
        ctl = self.proc.control
        self.proc.comm.reset()
        ctl.new_epoch()
        ctl.set_abort(False)
        self._needs_reset = False

    def _settle(self) -> None:
        """Before a new command: wait until the workers are done with an abandoned
        one (they were told to stop) and reset. Ctrl-C, the timeout and
        close() stop this wait too; the runtime then stays as it was."""
        ctl = self.proc.control
        if ctl.pending():
            self.abort()
            self.begin_wait()
            self.interrupt_workers()
            try:
                errors = ctl.collect(self._poll_settling)
            except _TimedOut as err:
                raise SynkTimeoutError(
                    f"worker ranks {err.ranks} are still busy with a command abandoned earlier and did "
                    f"not finish within timeout={self.timeout} s; synk.close() ends them",
                    err.ranks, self.timeout, usable=False) from None
            except _CloseRequested:
                raise _closed_meanwhile("command") from None
            except BaseException as err:
                raise as_interrupt(err)
            if errors:
                log.debug("errors of an abandoned command, dropped: %s", sorted(errors))
        self._reset_after_abort()

    def idle(self) -> bool:
        """Whether the fork is usable and every worker is idle, with no command
        running in this thread (a nested call) and nothing to settle or send
        first: the master may then read and write the values the workers
        published (see :mod:`synkhronos._kept.plans`)."""
        return (self.in_flight is None and not self._needs_reset and not self.close_requested
                and self.broken is None and not self.closed and self.proc.control.all_answered())

    def check_alive(self) -> None:
        """Raise WorkerDiedError (the fork broken) if a worker has died; checked
        at most every :data:`ALIVE_EVERY` seconds."""
        now = time.monotonic()
        if now < self._next_alive:
            return
        self._next_alive = now + ALIVE_EVERY
        try:
            self._watch_children()
        except WorkerDiedError:
            if self.in_flight is None:  # between steps: the other nodes hear of it now
                self._tell_break()
            raise

    def _tell_break(self) -> None:
        """The fork broke: across nodes, tell the others once, at a step's end (never
        between the exchanges of a step), so that a node waiting for this one raises
        at once instead of when this node acts again."""
        hook = self.on_break
        if hook is not None and self.broken is not None:
            self.on_break = None
            try:
                hook(self.broken)
            except Exception:  # noqa: BLE001 - the others then learn it at this node's close()
                log.debug("synkhronos: telling the other nodes of this node's failure failed",
                          exc_info=True)

    def _watch_children(self) -> None:
        """WorkerDiedError, the fork marked broken and the workers told, if a worker has died."""
        try:
            self.watch.poll()
        except WorkerDiedError as err:
            self.broken = err
            self.abort()
            raise

    def usable(self) -> None:
        if self.closed:
            raise SynkError("this synkhronos fork was closed (synk.close()); call synk.fork() "
                            "to start a new one and build its functions again")
        if self.broken is not None:
            raise SynkError(f"synkhronos is unusable after an earlier failure ({self.broken}); "
                            "call synk.close() and synk.fork() again")

    def run(self, cmd: Command, payload, local=None, body: bytes | None = None):
        """Send ``cmd`` to every worker, run ``local(proc, payload)`` here, wait for all.

        ``body``, when given, is ``([], payload)`` pickled already (a caller
        that sends the same message call after call keeps it; see
        :meth:`ControlBlock.post`).

        Returns what ``local`` returned; raises the most telling error of any
        process (a worker's carries its rank and traceback).
        """
        self.usable()
        _state.refuse_nested(cmd)
        self.in_flight = threading.get_ident()
        try:
            return self._run(cmd, payload, local, body)
        finally:
            self.in_flight = None
            if self.broken is not None:
                self._tell_break()
            self.close_if_requested()

    def step_alone(self, what: str, step: Callable, *args):
        """``step(*args)``: a step among nodes that this node master makes alone, with no
        command to its workers (a kept plan's exchange; the end of a call whose outputs
        rode the workers' answers). A command as far as close() and nested calls know,
        ``fork(timeout=...)`` counted from here; a timeout or close() meanwhile ends it
        with the error a command's would give (never the private stop itself), and
        close() asked meanwhile closes the fork at its end."""
        self.in_flight = threading.get_ident()
        self.alone = True
        self.begin_wait()
        try:
            return step(*args)
        except (_TimedOut, _CloseRequested) as stop:  # (the workers are idle: they are back)
            raise self._stopped(what, stop, back=True) from None
        finally:
            self.in_flight = None
            self.alone = False
            self.close_if_requested()

    def close_if_requested(self) -> None:
        """At the end of a command (or of join()): close the fork if close() was asked
        for meanwhile (by a signal handler, an Op or another thread)."""
        if self.close_requested and _state.current() is self:
            self._close()

    def _run(self, cmd: Command, payload, local, body):
        ctl = self.proc.control
        if self._needs_reset:  # an earlier command was abandoned or failed part-way
            self._settle()
        if self.close_requested:
            raise _closed_meanwhile(cmd.name.lower())
        if self.on_step is not None:
            self.on_step(cmd, payload)
        dropped = self.dropped
        if dropped:
            self.dropped = []
        self.kept.generation += 1  # any command may move what a kept record points into (Kept.moved)
        try:
            if dropped or body is None:
                ctl.post(cmd, (dropped, payload))
            else:
                ctl.post(cmd, None, body=body)
        except BaseException:  # nothing was sent (a full /dev/shm): the next command tells them
            self.dropped[:0] = dropped
            raise
        self.begin_wait()
        try:
            result = None if local is None else local(self.proc, payload)
        except WorkerDiedError:
            raise
        except BaseException as err:  # also Ctrl-C: free the workers, then re-raise
            return self._end(cmd, err)
        errors, stop = self._collect(None)
        if errors or stop is not None or self.close_requested:
            self._end(cmd, None, errors, stop)
        return result  # every process did its part

    def _end(self, cmd: Command, err, errors=None, stop=None):
        """The end of a command that did not go well: ``err`` is what this process
        raised (the workers are freed and waited for first), ``errors`` and
        ``stop`` what collecting their answers gave. Raises the most telling error."""
        local_err, aborted = None, False
        if err is not None:
            err = as_interrupt(err)
            if _is_stop(err):
                stop = err
            else:
                local_err = err
            # a failure reported through the protocol, or of the master's own share of a call
            # (it took its part): the workers finish the command as after any process's error
            if not isinstance(err, PeerFailed) and not is_own_share_failure(err):
                self.abort()
                aborted = True
            errors, stop = self._collect(stop)
        if stop is None and self.close_requested:  # the workers answered before a wait noticed it
            stop = _CloseRequested()
        if errors is None:  # abandoned, and some workers are still busy with it
            raise self._stopped(cmd.name.lower(), stop, back=False)
        if aborted or errors or stop is not None:
            self._reset_after_abort()
        if stop is not None:
            raise self._stopped(cmd.name.lower(), stop, back=True)
        unpacked = {rank: unpack_exception(blob) for rank, blob in errors.items()}
        if local_err is not None:
            unpacked[self.proc.rank] = local_err
        err = _most_telling(unpacked)
        if cmd is Command.CALL and not aborted:
            note_updates(err, self.proc, unpacked)
        raise err

    def _collect(self, stop):
        """Wait for every worker's answer to the posted command.

        With ``stop`` (Ctrl-C, a timeout, close() meanwhile), or once one
        comes during the wait, the command is abandoned: the workers are told
        to give it up (abort flag and interrupt signal) and get
        ``INTERRUPT_GRACE`` seconds to answer. A second Ctrl-C ends that
        grace at once. Returns ``(errors by rank, stop)``, errors None when
        some workers are still busy (the next command waits for them first).
        """
        ctl = self.proc.control
        grace_end = None
        while True:
            try:
                if stop is None:
                    return ctl.collect(self.poll), None
                if grace_end is None:
                    self.abort()
                    self.interrupt_workers()
                    grace_end = time.monotonic() + INTERRUPT_GRACE
                return ctl.collect(lambda: self._poll_abandoned(grace_end)), stop
            except WorkerDiedError:
                raise
            except _GraceOver:
                return None, stop
            except BaseException as err:
                err = as_interrupt(err)
                if not _is_stop(err):
                    self.broken = err
                    self.abort()
                    raise
                if stop is None:
                    stop = err
                elif isinstance(err, KeyboardInterrupt):
                    return None, stop

    def _stopped(self, what: str, stop: BaseException, back: bool) -> BaseException:
        """The exception that ends an abandoned command (``what``), saying whether the runtime is usable."""
        busy = self.proc.control.pending()
        state = ("every process is back and synkhronos is usable" if back else
                 f"worker ranks {busy} are still busy with it: the next command first waits for "
                 "them (they were told to stop), synk.close() ends them")
        if isinstance(stop, _TimedOut) and stop.exchange is not None:
            # an MPI exchange, once started, cannot be taken back: the nodes' communicator is gone
            return SynkTimeoutError(
                f"the other nodes did not reach this node's {what} command (its exchange "
                f"'{stop.exchange}' among the node masters) within timeout={self.timeout} s; this "
                f"node's processes were waiting for them. The command was abandoned and the other "
                f"nodes were told; the exchange among the nodes cannot be taken back, so this fork "
                f"cannot be used across nodes any more: call synk.close() and synk.fork() again, "
                f"on every node", [], self.timeout, usable=False)
        if isinstance(stop, _TimedOut):
            return SynkTimeoutError(
                f"worker ranks {stop.ranks} did not finish the {what} command within "
                f"timeout={self.timeout} s; the command was abandoned, and {state}",
                stop.ranks, self.timeout, usable=back)
        if isinstance(stop, _CloseRequested):
            return _closed_meanwhile(what)
        try:
            stop.add_note(f"synkhronos: the {what} command was abandoned in every process; {state}. "
                          "Updates it made may have been applied in some processes only.")
        except Exception:
            pass
        return stop


def note_updates(err: BaseException, proc, errors: dict) -> None:
    """Say on a failed call's exception which processes applied its updates: exactly
    those whose own share ran without error (the rule of a failed call); ``errors``:
    each failed process's error by local rank (empty: every share ran, the call failed
    afterwards). Across nodes it names this node's processes by global rank; every
    other node's follow the same rule. The local ranks whose shares failed are kept on
    ``err`` (``synk_failed_ranks``): across nodes, what the other nodes are told."""
    failed = sorted(r for r, e in errors.items() if not isinstance(e, (Aborted, PeerFailed)))
    try:
        err.synk_failed_ranks = failed  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an exception that takes no attributes: the others hear its text
        pass
    table = proc.comm.node_table()  # across nodes, global ranks (node-major) of this node's processes
    first = None if table is None else sum(table[1][:table[0]])
    applied = [r for r in range(proc.size) if r not in failed]
    where = ""
    if first is not None:
        applied, failed = [first + r for r in applied], [first + r for r in failed]
        where = (" of this node (global ranks; on every other node, the processes whose shares "
                 "ran without error applied them too)")
    try:
        err.add_note(f"synkhronos: this call's updates were applied by ranks {applied}, whose shares "
                     f"ran without error, and not by ranks {failed}{where}")
    except Exception:  # noqa: BLE001 - an exception that takes no notes still says what failed
        pass


def _most_telling(errors: dict):
    """The root cause among the processes' errors: not a follow-on abort, lowest rank."""
    for rank in sorted(errors):
        if not isinstance(errors[rank], (Aborted, PeerFailed)):
            return errors[rank]
    return errors[min(errors)]


class _TimedOut(BaseException):
    """Raised between wait slices once a command outlasted fork(timeout=...)."""

    def __init__(self, ranks, exchange=None):
        super().__init__(ranks)
        self.ranks = list(ranks)
        self.exchange = exchange  # across nodes: the exchange this node master waited in

    @property
    def notice(self) -> str:
        """What the other nodes are told (see collectives/mpi.py)."""
        if self.exchange is not None:
            return f"its fork(timeout=...) passed while it waited for the other nodes in '{self.exchange}'"
        return f"its fork(timeout=...) passed while it waited for its worker ranks {self.ranks}"


class _CloseRequested(BaseException):
    """Raised between wait slices once close() was called during the command."""

    notice = "synk.close() was called there during a command (from another thread or a signal handler)"


class _GraceOver(BaseException):
    """The workers did not come back within INTERRUPT_GRACE of an abandoned command."""


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` is the private exception of a wait that outlasted fork(timeout=...)
    (to be turned into a SynkTimeoutError saying what timed out)."""
    return isinstance(err, _TimedOut)


def _is_stop(err: BaseException) -> bool:
    """Ends the command without meaning that anything failed: Ctrl-C, SystemExit
    from a signal handler, a timeout, close() meanwhile."""
    return not isinstance(err, Exception)


def _closed_meanwhile(what: str) -> SynkError:
    return SynkError(f"synk.close() was called (from another thread or a signal handler) during "
                     f"this {what}; the command was abandoned and the fork is closed")
