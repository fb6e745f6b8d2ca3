"""AsyncEngine's delivery of a step's outputs: one wake-up per event loop, order kept, on_done after the last
output, a closed loop or a failing callback harming no other stream (no engine thread: the step's outputs are
handed to ``_deliver_all`` directly, the loops are recorders)."""

from __future__ import annotations

from types import SimpleNamespace

from loraplex.platform.async_engine import AsyncEngine, StreamTarget, _run_in_order


class RecordingLoop:
    def __init__(self, closed: bool = False) -> None:
        self.calls: list[tuple] = []
        self.closed = closed

    def call_soon_threadsafe(self, fn, *args) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((fn, args))

    def run(self) -> None:
        for fn, args in self.calls:
            fn(*args)


class ListQueue:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def put_nowait(self, item) -> None:
        self.log.append((self.name, item.text))


def _out(request_id: str, text: str, finished: bool = False):
    return SimpleNamespace(request_id=request_id, text=text, finished=finished)


def test_a_step_wakes_each_loop_once_in_order_with_on_done_after_the_last_output():
    log: list = []
    loop_a, loop_b, closed = RecordingLoop(), RecordingLoop(), RecordingLoop(closed=True)
    engine = AsyncEngine(engine=None)
    engine._streams = {
        "r1": StreamTarget(loop_a, ListQueue(log, "r1"), None, on_done=lambda: log.append(("r1", "done"))),
        "r2": StreamTarget(loop_a, ListQueue(log, "r2"), None),
        "r3": StreamTarget(loop_b, ListQueue(log, "r3"), None),
        "r4": StreamTarget(closed, ListQueue(log, "r4"), None),
    }
    engine._deliver_all([_out("r1", "a"), _out("r2", "b"), _out("gone", "x"), _out("r3", "c"), _out("r4", "d"),
                         _out("r1", "e", finished=True), _out("r2", "f")])
    assert len(loop_a.calls) == 1 and len(loop_b.calls) == 1  # not one per output
    assert "r1" not in engine._streams and {"r2", "r3", "r4"} <= set(engine._streams)
    loop_a.run()
    loop_b.run()
    assert log == [("r1", "a"), ("r2", "b"), ("r1", "e"), ("r1", "done"), ("r2", "f"), ("r3", "c")]


def test_a_failing_delivery_callback_does_not_stop_the_rest(caplog):
    ran = []

    def boom() -> None:
        raise ValueError("listener gone wrong")

    _run_in_order([lambda: ran.append(1), boom, lambda: ran.append(3)])
    assert ran == [1, 3]
    assert "stream delivery callback failed" in caplog.text
