"""A SIGTERM that lands at any moment of a server's wait loop is seen. Setting a `threading.Event` from the signal
handler while the main thread polled that Event deadlocked now and then: a `tandem serve` launcher that never
passed the SIGTERM on to its router (seen as a CI failure of the drain test)."""

import selectors
import signal
import subprocess
import sys
import time

CHILD = """
from tandem.worker_setup import StopSignal
stop = StopSignal()
while True:
    print("waiting", flush=True)
    while not stop.wait(0):  # the tightest poll: most time inside wait, where the Event held its lock
        pass
    stop.received = False
"""


def _line(proc, sel, timeout: float) -> str | None:
    return proc.stdout.readline() if sel.select(timeout) else None


def test_a_signal_at_any_moment_of_the_wait_loop_is_seen():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        assert _line(proc, sel, 60) == "waiting\n"
        for i in range(300):
            time.sleep(0.001 * (i % 7))  # land at varying points of the poll
            proc.send_signal(signal.SIGTERM)
            assert _line(proc, sel, 10) == "waiting\n", f"signal {i} was not seen"
    finally:
        proc.kill()
        proc.wait(10)
