"""A periodic job on a daemon thread, for the serving process's background work.

The hot-reload watcher and the pod-status publisher both poll things they do not control (a
shared volume, the Kubernetes API) from inside a serving process. Whatever those throw must not
end the loop, since a watcher that died once would never load another version, and shutdown
must not wait out a full interval; so both use this one loop instead of hand-rolled threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class BackgroundLoop:
    """Calls ``fn`` at once, then every ``interval_s`` seconds, until :meth:`stop`.

    An exception from ``fn`` is logged with its traceback and the loop carries on at the next
    interval. :meth:`stop` wakes the thread at once rather than after the current wait.
    ``interval_s`` is read before each wait, so it may be changed while the loop runs.
    """

    def __init__(self, fn: Callable[[], object], interval_s: float, *, name: str):
        self.fn = fn
        self.interval_s = interval_s
        self.name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread; does nothing while one is running."""
        if self.is_alive():
            return
        self._stop = threading.Event()  # a fresh one: a loop stopped before may run again
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> bool:
        """Ask the loop to end and wait up to ``timeout`` s; True when the thread has ended.

        A call of ``fn`` that is under way is not interrupted; when it outlasts ``timeout`` the
        daemon thread is left to finish it (and then ends) and this returns False.
        """
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        if thread is not threading.current_thread():
            thread.join(timeout)
        if thread.is_alive():
            logger.warning("adaflash: %s did not stop within %s s", self.name, timeout)
            return False
        self._thread = None
        return True

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        stop = self._stop
        while not stop.is_set():
            try:
                self.fn()
            except Exception:  # the loop must outlive anything its job throws
                logger.exception("adaflash: %s failed; retrying in %s s", self.name, self.interval_s)
            stop.wait(self.interval_s)
