"""The rollout engine's weights lock: many generate() readers or one weight-swap writer, every wait bounded."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Optional


class LockTimeout(TimeoutError):
    """A wait for the engine's reader/writer lock ran past its timeout (see `RWLock`)."""


class RWLock:
    """Many readers or one writer; a waiting writer blocks new readers (no writer starvation).

    Every wait is bounded by `timeout_s` (None: unbounded): a writer that cannot get the lock gives
    up with `LockTimeout` (and stops blocking new readers), so a reader that never releases cannot
    stall weight updates or the requests queued behind them forever. A reader fails only when a
    writer *holds* the lock past the reader's deadline; behind a queued writer it waits until that
    writer gets the lock or gives up. `owner` and `setting` name the
    lock and the knob in the error."""

    def __init__(self, timeout_s: Optional[float] = None, owner: str = "RWLock", setting: str = "timeout_s"):
        self.timeout_s, self.owner, self.setting = timeout_s, owner, setting
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def read(self):
        with self._cond:
            deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
            while self._writer or self._writers_waiting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if self._writer:
                        raise LockTimeout(f"{self.owner}: a request waited longer than {self.timeout_s}s "
                                          f"({self.setting}) for the read lock while a weight swap held the write "
                                          "lock; raise it if swaps legitimately take longer")
                    left = self.timeout_s  # a queued swap gives up within its own timeout: wait for that
                self._cond.wait(left)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def let_writers_in(self) -> bool:
        """Called by a thread that holds the read side (inside `read`): if a writer is waiting,
        release the read side, let the writer(s) go, take it back (bounded like `read`). Whether
        a writer was waiting. A request decoding in steps calls it between steps to pick up a
        weight swap in flight (`RolloutEngine(inflight_updates=True)`)."""
        with self._cond:
            if not self._writers_waiting:
                return False
            self._readers -= 1
            self._cond.notify_all()
            deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
            try:
                while self._writer or self._writers_waiting:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise LockTimeout(f"{self.owner}: a request waited longer than {self.timeout_s}s "
                                          f"({self.setting}) to resume after a weight swap in flight")
                    self._cond.wait(left)
            finally:
                self._readers += 1  # `read`'s exit releases it, also after a timeout
            return True

    @contextlib.contextmanager
    def write(self):
        with self._cond:
            self._writers_waiting += 1
            acquired = False
            try:
                acquired = self._cond.wait_for(lambda: not (self._writer or self._readers), self.timeout_s)
            finally:
                self._writers_waiting -= 1
                if not acquired:
                    self._cond.notify_all()  # requests queued behind this writer may go on
            if not acquired:
                held = f"{self._readers} generate() request(s) held the read lock" if self._readers else \
                    "another weight swap held the write lock"
                raise LockTimeout(f"{self.owner}: a weight swap waited longer than {self.timeout_s}s ({self.setting}) "
                                  f"for the write lock: {held}; the engine keeps its current weights. Raise it if "
                                  "requests legitimately run longer, else find the request that never returns")
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
