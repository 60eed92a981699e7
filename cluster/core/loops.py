"""Background loops of the actors, kept alive.

asyncio holds only a weak reference to a task, so a loop started with a bare create_task() can
be garbage-collected mid-flight; and a loop whose body raises once stops for good. A
BackgroundLoops keeps every task it starts, and each period's error is logged, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("raykv.loops")


class BackgroundLoops:
    """Periodic coroutines that survive their own errors, owned until cancel_all()."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.errors: dict[str, int] = {}

    def every(self, name: str, period_s: float, body: Callable[[], Awaitable[object]]) -> None:
        """Run `await body()` every `period_s` seconds (after the first sleep), forever."""
        assert name not in self.tasks, f"loop {name!r} already runs"
        self.errors[name] = 0
        self.tasks[name] = asyncio.get_running_loop().create_task(
            self._run(name, period_s, body), name=f"raykv-{name}")

    async def _run(self, name: str, period_s: float,
                   body: Callable[[], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed period is logged; the next one runs as usual
                self.errors[name] += 1
                log.exception("background loop %s failed (error %d); carrying on", name,
                              self.errors[name])

    def running(self) -> list[str]:
        return sorted(name for name, task in self.tasks.items() if not task.done())

    def cancel_all(self) -> None:
        for task in self.tasks.values():
            task.cancel()
