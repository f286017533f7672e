"""The /calibrate lane: a fair line, a turn that shrinks while others wait, an hour's bound.

The lane runs on a clock the tests move by hand, so no verdict depends on how fast the machine
is; the threads' joins are hang guards, many times what the work needs.
"""

import threading
import time

import pytest

from bragkit.serving.lane import Lane
from bragkit.serving.limits import RequestRefused

HANG_GUARD = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lane(clock: Clock, **options) -> Lane:
    settings = {"slots": 1, "waiting": 2, "wait_seconds": 600, "share_seconds": 120, "seconds_per_hour": 1800}
    return Lane(**{**settings, **options}, clock=clock)


def ran(the_lane: Lane, clock: Clock, address: str, seconds: float) -> None:
    with the_lane.turn(address):
        clock.now += seconds


class Waiter(threading.Thread):
    """A request that asks for a turn, records when it got it or why not, and holds it until told."""

    def __init__(self, the_lane: Lane, address: str, log: list, gone=lambda: False) -> None:
        super().__init__(daemon=True)
        self.lane, self.address, self.log, self.gone = the_lane, address, log, gone
        self.release, self.running, self.refusal = threading.Event(), threading.Event(), None

    def run(self) -> None:
        try:
            with self.lane.turn(self.address, self.gone) as turn:
                self.turn = turn
                self.log.append(self.address)
                self.running.set()
                self.release.wait(HANG_GUARD)
        except RequestRefused as err:
            self.refusal = str(err)


def until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.01)


def test_addresses_that_keep_the_lane_busy_cannot_keep_a_newcomer_out():
    # Round 6, finding 1: a few addresses, each within its share, kept "Check these documents"
    # refused. Now the newcomer waits in line, takes the place of the waiter that has had the
    # most of the lane, the running self-test's turn ends once its share is spent, and the
    # newcomer runs next.
    clock = Clock()
    the_lane, log = lane(clock), []
    for i, address in enumerate(("hostile-a", "hostile-b", "hostile-c")):
        ran(the_lane, clock, address, 100 + 50 * i)  # each has had the lane before
    running = Waiter(the_lane, "hostile-a", log)
    running.start()
    running.running.wait(HANG_GUARD)
    assert not running.turn.should_yield()  # nobody waits: it may use its whole bound
    waiting = [Waiter(the_lane, a, log) for a in ("hostile-b", "hostile-c")]
    for w in waiting:
        w.start()
    until(lambda: len(the_lane._line) == 2, "two waiters in line")
    honest = Waiter(the_lane, "honest", log)
    honest.start()
    until(lambda: waiting[1].refusal is not None, "the waiter that had the most is bumped")
    assert "took your place" in waiting[1].refusal and honest.refusal is None
    assert not running.turn.should_yield()  # within its share
    clock.now += 120
    assert running.turn.should_yield()  # others wait and its share is spent: it ends with what it has
    running.release.set()
    honest.running.wait(HANG_GUARD)
    assert log == ["hostile-a", "honest"]  # the newcomer runs before the waiter that came earlier
    honest.release.set()
    waiting[0].running.wait(HANG_GUARD)
    waiting[0].release.set()
    for w in (running, honest, *waiting):
        w.join(HANG_GUARD)
    assert log == ["hostile-a", "honest", "hostile-b"]


def test_an_address_is_bounded_to_its_seconds_of_the_lane_each_hour():
    clock = Clock()
    the_lane = lane(clock, seconds_per_hour=300)
    ran(the_lane, clock, "busy", 200)
    with the_lane.turn("busy") as turn:
        assert not turn.should_yield()
        clock.now += 100
        assert turn.should_yield()  # its hour is spent, whoever waits
    with pytest.raises(RequestRefused, match=r"300 s of /calibrate this hour.*retry in \d+ min"):
        with the_lane.turn("busy"):
            pass
    with the_lane.turn("another"):  # the others' hours are their own
        pass
    clock.now += 3600
    with the_lane.turn("busy"):  # an hour later it may run again
        pass


def test_a_waiter_leaves_the_line_when_its_caller_goes_or_its_wait_is_over():
    clock = Clock()
    the_lane, log = lane(clock, wait_seconds=30), []
    holder = Waiter(the_lane, "holder", log)
    holder.start()
    holder.running.wait(HANG_GUARD)
    left = threading.Event()
    gone = Waiter(the_lane, "gone", log, gone=left.is_set)
    gone.start()
    until(lambda: len(the_lane._line) == 1, "one waiter")
    left.set()
    gone.join(HANG_GUARD)
    assert "left while it waited" in gone.refusal and not the_lane._line
    patient = Waiter(the_lane, "patient", log)
    patient.start()
    until(lambda: len(the_lane._line) == 1, "one waiter")
    clock.now += 31
    patient.join(HANG_GUARD)
    assert "waited 30 s" in patient.refusal and not the_lane._line
    holder.release.set()
    holder.join(HANG_GUARD)
    assert log == ["holder"]


def test_a_full_line_refuses_a_newcomer_that_has_had_as_much_as_every_waiter():
    clock = Clock()
    the_lane, log = lane(clock, waiting=1), []
    holder, first = Waiter(the_lane, "holder", log), Waiter(the_lane, "first", log)
    holder.start()
    holder.running.wait(HANG_GUARD)
    first.start()
    until(lambda: len(the_lane._line) == 1, "one waiter")
    with pytest.raises(RequestRefused, match="lane is full"):
        with the_lane.turn("second"):
            pass
    holder.release.set()
    first.running.wait(HANG_GUARD)
    first.release.set()
    for w in (holder, first):
        w.join(HANG_GUARD)
    assert log == ["holder", "first"]
