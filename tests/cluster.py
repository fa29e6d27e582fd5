"""Starts `tandem serve` as a subprocess on 127.0.0.1 (free ports) for multi-process tests, and stops it."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tandem.client import TandemClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Cluster:
    def __init__(self, *flags: str, start_timeout: float = 180.0):
        self.log: list[str] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TRITON_INTERPRET", None)  # the servers run the torch reference ops on CPU
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", "--metrics-port", "0", *flags], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        ready: queue.Queue = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                if line.startswith("TANDEM serve "):
                    ready.put(dict(kv.split("=", 1) for kv in line.split()[2:]))
            ready.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            address = ready.get(timeout=start_timeout)
        except queue.Empty:
            address = None
        if address is None:
            self.stop()
            raise RuntimeError("tandem serve did not start:\n" + "".join(self.log[-50:]))
        self.address = address["grpc"]
        self.metrics = address.get("metrics", "").split(",")  # router first, then prefill, then decode workers
        self.client = TandemClient(self.address)
        self.client.wait_ready(60)

    def stop(self, timeout: float = 40.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if hasattr(self, "client"):
            self.client.close()
        return self.proc.returncode

    def wait_idle(self, timeout: float = 15.0):
        """Until every worker reports nothing in use (blocks, slots, leases, requests); returns the last report."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.client.server_info()
            busy = [w for w in info.workers
                    if w.load.free_kv_blocks != w.load.total_kv_blocks or w.load.active_leases
                    or w.load.free_state_slots != w.load.total_state_slots or w.load.running_requests
                    or w.load.waiting_requests]
            if not busy or time.monotonic() > deadline:
                return info
            time.sleep(0.1)


def assert_idle(cluster: Cluster) -> None:
    info = cluster.wait_idle()
    for w in info.workers:
        ld = w.load
        assert w.healthy, w
        assert ld.free_kv_blocks == ld.total_kv_blocks > 0, (w.address, ld)
        assert ld.free_state_slots == ld.total_state_slots > 0, (w.address, ld)
        assert ld.active_leases == ld.running_requests == ld.waiting_requests == 0, (w.address, ld)
