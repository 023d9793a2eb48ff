"""NVML calls with a deadline: a hung driver call must not blind the enforcer.

A GPU that fell off the bus (or a wedged driver) can make an NVML call block forever. Python cannot
interrupt a thread inside a C call, so each NVML call runs on one long-lived worker thread and the
poll thread waits for it with a deadline. A call that misses its deadline becomes :class:`NvmlHung`
for the poll loop (which then continues every throttled process and keeps its SIGKILL timers going);
the worker stays inside the hung call, and every later call is refused at once until that call
returns (so hung calls never pile up). If it never returns, only a new process can use NVML again:
``/healthz`` fails (``Health.nvml_hung``) and the kubelet restarts the sidecar, whose stopped-state
file lets it continue whatever this one held stopped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpufence.enforcer.observe.nvml import NvmlUnavailable

T = TypeVar("T")


class NvmlHung(NvmlUnavailable):
    """An NVML call did not return within its deadline (or an earlier one still has not)."""


class DeadlineRunner:
    def __init__(self, timeout_seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds!r}")
        self.timeout = timeout_seconds
        self._clock = clock
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], _Result]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy_since: float | None = None  # the call in progress started then (None: idle)
        self._busy_name = ""
        self._thread = threading.Thread(target=self._work, name="gpufence-nvml", daemon=True)
        self._thread.start()

    def hung_for(self) -> float | None:
        """Seconds the current call has run past its deadline; None when no call is overdue."""
        with self._lock:
            if self._busy_since is None:
                return None
            late = self._clock() - self._busy_since - self.timeout
        return late if late > 0 else None

    def call(self, name: str, fn: Callable[[], T], *, idle: Callable[[], float | None] | None = None) -> T:
        """``fn()`` on the worker thread; NvmlHung after ``timeout`` seconds or if a call is stuck.

        ``idle`` is called while waiting and returns the seconds until it wants to run again (None:
        not before the deadline): the poll loop's SIGKILL timers keep firing during a slow call.
        """
        with self._lock:
            if self._busy_since is not None:
                stuck = self._clock() - self._busy_since
                raise NvmlHung(f"NVML call {self._busy_name} has not returned for {stuck:.1f}s")
            started = self._busy_since = self._clock()
            self._busy_name = name
        result = _Result()
        self._jobs.put((fn, result))
        deadline = started + self.timeout
        while True:
            wait = deadline - self._clock()
            if idle is not None:
                wanted = idle()
                if wanted is not None:
                    wait = min(wait, max(wanted, 0.0))
            if result.done.wait(max(wait, 0.0)):
                return result.get()
            if self._clock() >= deadline:
                raise NvmlHung(f"NVML call {name} did not return within {self.timeout:g}s")

    def _work(self) -> None:
        while True:
            fn, result = self._jobs.get()
            try:
                result.value = fn()
            except BaseException as exc:  # handed to the caller, who decides
                result.error = exc
            finally:
                with self._lock:
                    self._busy_since = None
                result.done.set()


class _Result:
    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value
