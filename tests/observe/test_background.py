"""Calls to a tracking server from a thread of their own (`framework.observe.background`): the caller
never waits, a call that does not return ends the logging with one line, and the end is bounded."""

from __future__ import annotations

import threading

from framework.observe.background import Background


def test_a_stuck_call_never_holds_the_caller_and_is_said_once(capsys):
    release, made = threading.Event(), []
    sender = Background("tracker", "http://127.0.0.1:1", timeout_s=0.2)
    sender.submit(made.append, 1)
    sender.submit(release.wait)  # a server that stopped answering: the call never returns
    for i in range(2, 50):
        sender.submit(made.append, i)  # queued behind it, each at once
    while sender.said is None:  # the next submits find the call stuck past timeout_s
        sender.submit(made.append, -1)
        release.wait(0.05)
    sender.submit(made.append, -2)
    sender.close()  # the server is known to be down: nothing more to wait for
    assert made == [1] and sender.dropped >= 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tracker: http://127.0.0.1:1 has not answered for 0.2 s;")
    assert "dropped (metrics.jsonl has every value)" in err
    release.set()


def test_the_end_waits_for_calls_that_return_and_a_failure_is_one_line(capsys):
    made = []
    sender = Background("tracker", "somewhere", timeout_s=5)

    def fail():
        raise ConnectionError("refused\nsecond line")

    for i in range(100):
        sender.submit(made.append, i)
        if i in (10, 20):
            sender.submit(fail)
    sender.close()
    assert made == list(range(100))
    assert capsys.readouterr().err == (
        "tracker: logging failed (ConnectionError: refused); what cannot be sent is dropped "
        "(metrics.jsonl has every value)\n"
    )
