"""A port in use is an error at start, never shared: gRPC's SO_REUSEPORT (on by default) let a second server bind
a taken port and take part of its calls."""

import os
import signal
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from tandem.rpc.server import Server


@pytest.fixture
def grpc_holder():
    """A gRPC server with grpc's default options (SO_REUSEPORT on) holding a port; returns the port."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0).wait()


def test_server_refuses_a_taken_port(grpc_holder):
    with pytest.raises(OSError, match=f"127.0.0.1:{grpc_holder}"):
        Server(max_workers=1).start("127.0.0.1", grpc_holder)
    # and a server that holds a port keeps it to itself
    ours = Server(max_workers=1)
    port = ours.start("127.0.0.1", 0)
    try:
        other = grpc.server(futures.ThreadPoolExecutor(1))
        with pytest.raises(RuntimeError, match="Failed to bind"):
            other.add_insecure_port(f"127.0.0.1:{port}")
    finally:
        ours.stop(0)


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`tandem ARGV` (rc, stdout, stderr); one that is still running after 60 s (it started on a taken port) is
    killed with everything it started, and the test fails."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"tandem {' '.join(argv)} started on a taken port")
    return proc.returncode, out, err


@pytest.mark.parametrize("flag,what", [("--port", "gRPC"), ("--http-port", "HTTP"), ("--metrics-port", "metrics")])
def test_serve_on_a_taken_port_fails_at_once(grpc_holder, flag, what):
    """Exits non-zero before starting any worker, with one line naming the port."""
    rc, out, err = run_cli("serve", "--model", "tiny-moe", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                           "--metrics-port", "0", flag, str(grpc_holder))
    assert rc != 0
    assert err.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{grpc_holder} ({what}): Address already "
                                        "in use"], err
    assert "TANDEM" not in out  # nothing announced: no worker was started


def test_a_standalone_worker_on_a_taken_port_fails_at_once(grpc_holder):
    rc, _, err = run_cli("decode-worker", "--model", "tiny-moe", "--host", "127.0.0.1", "--port", str(grpc_holder),
                         "--transfer-port", "0")
    assert rc != 0
    assert err.strip().splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{grpc_holder} (gRPC): Address " \
                                           "already in use", err
