"""Work handed to a forked copy of this process, started before its input exists.

A run's timeline plot costs about half a second, most of it importing matplotlib, after a simulation that keeps
one core busy. Forked before the simulation, a child imports matplotlib on the second core meanwhile, then waits
for the figure's data on a pipe; the parent sends it and writes its own files while the child draws.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import traceback
from typing import Any, Callable


def fork_is_safe() -> bool:
    """A forked child inherits every lock as it was: safe only with no other thread (tqdm's monitor sleeps and
    the child never touches tqdm) and without torch's thread pools."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.name != "tqdm_monitor"]
    return hasattr(os, "fork") and sys.platform != "darwin" and not others and "torch" not in sys.modules


class Deferred:
    """`work(payload)` in a child forked now, after `prepare()`, once `send(payload)` gives it its input; where a
    fork is not safe, `send` runs it here. `wait` raises if it failed; `cancel` lets the child go unused."""

    def __init__(self, prepare: Callable[[], None], work: Callable[[Any], None], what: str):
        self.work, self.what, self.pid, self._pipe = work, what, None, None
        if not fork_is_safe():
            return
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(write)
            code = 1
            try:
                prepare()
                with os.fdopen(read, "rb") as pipe:
                    payload = pickle.load(pipe)
                work(payload)
                code = 0
            except EOFError:  # cancelled: nothing to do
                code = 0
            except BaseException:  # noqa: BLE001 - reported here, and by the parent's wait as a failure
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.close(read)
        self.pid, self._pipe = pid, os.fdopen(write, "wb")

    def send(self, payload: Any) -> None:
        if self._pipe is None:
            self.work(payload)
            return
        with self._pipe as pipe:
            pickle.dump(payload, pipe, protocol=pickle.HIGHEST_PROTOCOL)
        self._pipe = None

    def wait(self) -> None:
        if self.pid is None:
            return
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{self.what} failed in its process (exit status {os.waitstatus_to_exitcode(status)};"
                               " its traceback is above)")

    def cancel(self) -> None:
        """The input will never come: the child exits (a no-op once sent)."""
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        if self.pid is not None:
            os.waitpid(self.pid, 0)
            self.pid = None
