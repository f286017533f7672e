"""The /calibrate lane: who runs a calibration now, who waits in line, and whose turn is next.

A self-test is long (``BRAG_SELF_TEST_SECONDS``) and the lane has few slots, so a handful of
addresses must not hold it. Three rules do it (:class:`Lane`):

- *A fair line.* A request that finds every slot taken waits (up to ``wait_seconds``) rather
  than being refused; the next free slot goes to the waiting address that has had the fewest
  seconds of the lane in the last hour. When the line is full, a newcomer that has had fewer
  takes the place of the waiter that has had the most (that one is told why).
- *A turn that shrinks.* Once someone waits, a running self-test may go on for its
  ``share_seconds`` and then ends with a fit on the questions it has done (:meth:`Turn.should_yield`).
- *An hour's bound.* An address has at most ``seconds_per_hour`` of the lane in any hour; past
  it, it is refused, with when to retry.

No Gradio here: the server asks for a turn with the caller's address and its ``gone`` check.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .limits import RequestRefused, refused

HOUR = 3600.0
POLL = 0.25  # how often a waiter checks that its caller is still there (a hang guard's step)


@dataclass
class Turn:
    """One request's place in the lane: waiting, then running, then charged to its address."""

    address: str
    arrived: int
    lane: Lane
    started: float | None = None
    bumped: str = ""  # why it lost its place in line, if it did

    def should_yield(self) -> bool:
        """Whether a running self-test should end now, with what it has.

        Its share is spent while others wait, or its address's hour is.
        """
        return self.lane.should_yield(self)


@dataclass
class Lane:
    """The /calibrate lane's slots, its line and each address's seconds of it (see the module)."""

    slots: int
    waiting: int  # places in line
    wait_seconds: float  # the longest a request waits for its turn
    share_seconds: float  # a running self-test's share once others wait
    seconds_per_hour: float  # one address's seconds of the lane in any hour
    clock: Callable[[], float] = time.monotonic
    _running: list[Turn] = field(default_factory=list)
    _line: list[Turn] = field(default_factory=list)
    _used: list[tuple[str, float, float]] = field(default_factory=list)  # (address, start, end)
    _count: Iterator[int] = field(default_factory=itertools.count)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    @contextmanager
    def turn(self, address: str, gone: Callable[[], bool] = lambda: False) -> Iterator[Turn]:
        """Wait for a slot fairly, hold it for the block, then charge its seconds to ``address``."""
        with self._changed:
            mine = self._join(address)
            try:
                self._wait(mine, gone)
            except BaseException:
                if mine in self._line:
                    self._line.remove(mine)
                self._changed.notify_all()
                raise
            self._line.remove(mine)
            mine.started = self.clock()
            self._running.append(mine)
        try:
            yield mine
        finally:
            with self._changed:
                self._running.remove(mine)
                self._used.append((address, mine.started, self.clock()))
                self._changed.notify_all()

    def used(self, address: str) -> float:
        """The seconds ``address`` has had of the lane in the last hour, its running turns' among them."""
        now = self.clock()
        self._used = [u for u in self._used if u[2] > now - HOUR]
        done = sum(end - max(start, now - HOUR) for who, start, end in self._used if who == address)
        running = sum(now - t.started for t in self._running if t.address == address and t.started)
        return done + running

    def should_yield(self, turn: Turn) -> bool:
        """Whether ``turn``, running, should end now (:meth:`Turn.should_yield`)."""
        with self._changed:
            if turn.started is None:
                return False
            if self.used(turn.address) >= self.seconds_per_hour:
                return True
            return bool(self._line) and self.clock() - turn.started >= self.share_seconds

    def _join(self, address: str) -> Turn:
        """A place in line for ``address``, or a refusal: its hour is spent, or the line is full."""
        had = self.used(address)
        if had >= self.seconds_per_hour:
            raise _spent(self.seconds_per_hour, self._retry_after(address))
        mine = Turn(address, next(self._count), self)
        if len(self._line) >= self.waiting:
            most = max(self._line, key=lambda t: (self.used(t.address), t.arrived))
            if self.used(most.address) <= had:
                raise refused(
                    f"Busy: the /calibrate lane is full ({self.slots} running, {self.waiting} waiting); "
                    "retry in a minute."
                )
            most.bumped = "another address that has had less of the lane this hour took your place in line"
            self._line.remove(most)
        self._line.append(mine)
        self._changed.notify_all()
        return mine

    def _wait(self, mine: Turn, gone: Callable[[], bool]) -> None:
        """Until it is ``mine``'s turn; refused if bumped, if its caller goes, or past ``wait_seconds``."""
        deadline = self.clock() + self.wait_seconds
        while not self._next(mine):
            if mine.bumped:
                raise refused(f"Busy: {mine.bumped}; retry in a minute.")
            if gone():
                raise refused("The caller left while it waited for the /calibrate lane; nothing was run.")
            if self.clock() >= deadline:
                raise refused(
                    f"Busy: waited {self.wait_seconds:g} s for the /calibrate lane "
                    "(BRAG_SELF_TEST_WAIT_SECONDS); retry in a minute."
                )
            self._changed.wait(POLL)

    def _next(self, mine: Turn) -> bool:
        """Whether a slot is free and ``mine`` is the waiter with the fewest seconds (then the earliest)."""
        if len(self._running) >= self.slots or mine not in self._line:
            return False
        return min(self._line, key=lambda t: (self.used(t.address), t.arrived)) is mine

    def _retry_after(self, address: str) -> float:
        """Seconds until ``address`` is back under its hour's bound (its oldest seconds age out)."""
        now, over = self.clock(), self.used(address) - self.seconds_per_hour
        for _, start, end in sorted(u for u in self._used if u[0] == address):
            over -= end - max(start, now - HOUR)
            if over < 0:
                return max(0.0, end - (now - HOUR))
        return HOUR


def _spent(per_hour: float, retry: float) -> RequestRefused:
    return refused(
        f"Your address has had its {per_hour:g} s of /calibrate this hour "
        f"(BRAG_SELF_TEST_SECONDS_PER_HOUR); retry in {max(1, round(retry / 60))} min."
    )
