"""The serving image: `make image` builds the CPU variant, `tandem serve` in it answers a gRPC and an HTTP request from
outside the container, both health services report SERVING, the manifests' flags exist in the image's CLI, and SIGTERM
drains a request in flight to exit code 0. Needs a container engine (podman, or docker with a running daemon) and
skips with the reason where there is none.

No registry is assumed: the base image is a minimal Debian (debootstrap, then imported), built once and reused. A
torch CPU wheel in $TANDEM_TORCH_WHEELS (default /opt/wheels) is used when there is one, else PyTorch's CPU index."""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_deploy import OVERLAYS, container, deployments, help_flags, make_image_tag, manifest_flags

from tandem.client import TandemClient
from tandem.engine.sampling_params import SamplingParams
from tandem.rpc import common_pb2

ROOT = Path(__file__).resolve().parents[1]
BASE = "localhost/tandem-base:bookworm"
DEBIAN_PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BUILD_TIMEOUT = 1500  # a cold build installs torch and the dependencies; a cached one takes seconds
START_TIMEOUT = 240
DRAIN_TIMEOUT = 30  # the container's --drain-timeout
UID = "10001"  # the manifests' runAsUser


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _engine() -> list[str]:
    if shutil.which("podman"):
        # runc where present: the runtime these machines run podman with (crun, podman's usual default, may be absent)
        cmd = ["podman", "--runtime", "runc"] if shutil.which("runc") else ["podman"]
        if _works([*cmd, "info"]):
            return cmd
    if shutil.which("docker") and _works(["docker", "info"]):
        return ["docker"]
    pytest.skip("no container engine: neither podman nor a docker with a running daemon")


def _ulimits() -> list[str]:
    # The engine's default limits can exceed what this host grants, and a runtime without CAP_SYS_RESOURCE cannot
    # raise them: pass this process's own, the process count at most pid_max (more means nothing, and was refused).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    return ["--ulimit", f"nofile={soft}:{hard}", "--ulimit", f"nproc={nproc}:{nproc}"]


def _base_image(engine: list[str]) -> None:
    """A minimal Debian with Python, imported once as BASE (no registry needed)."""
    if _works([*engine, "image", "exists" if engine[0] == "podman" else "inspect", BASE]):
        return
    if not shutil.which("debootstrap") or os.geteuid() != 0:
        pytest.skip(f"no base image {BASE} and no way to build one (debootstrap, as root)")
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        out = subprocess.run(["debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}", "bookworm",
                              str(rootfs), DEBIAN_MIRROR], check=False, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / cache, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([*engine, "import", "--change",
                        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "-", BASE],
                       stdin=tar.stdout, check=True, capture_output=True, timeout=300)
        tar.stdout.close()
        assert tar.wait(60) == 0


def _build_flags(engine: list[str]) -> list[str]:
    flags = ["--network", "host", "--build-arg", f"BASE_IMAGE={BASE}", *_ulimits()]
    if engine[0] == "podman":
        flags.append("--pull=never")  # the base is local; podman would otherwise try a registry
    wheels = Path(os.environ.get("TANDEM_TORCH_WHEELS", "/opt/wheels"))
    if list(wheels.glob("torch-*+cpu-*.whl")):
        flags += ["--build-context", f"wheels={wheels}"]
    # pip's trust store on this host (a TLS-intercepting proxy's CA) goes to the build as a secret, not into the image
    if os.environ.get("PIP_CERT") and Path(os.environ["PIP_CERT"]).is_file():
        flags += ["--secret", f"id=pip-ca,src={os.environ['PIP_CERT']}"]
    return flags


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Container:
    def __init__(self, engine: list[str], name: str):
        self.engine, self.name = engine, name

    def run(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.engine, *args], capture_output=True, text=True, timeout=timeout, check=check)

    def running(self) -> bool:
        out = self.run("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return out.stdout.strip() == "true"

    def logs(self) -> str:
        out = self.run("logs", self.name, check=False)
        return out.stdout + out.stderr


@pytest.fixture(scope="module")
def engine() -> list[str]:
    return _engine()


@pytest.fixture(scope="module")
def image(engine) -> str:
    _base_image(engine)
    # `make image`, as an operator runs it, with this machine's flags
    out = subprocess.run(["make", "image", f"ENGINE={' '.join(engine)}",
                          f"IMAGE_FLAGS={' '.join(_build_flags(engine))}"], cwd=ROOT, timeout=BUILD_TIMEOUT,
                         check=False, capture_output=True, text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return make_image_tag("cpu")


@pytest.fixture(scope="module")
def served(engine, image):
    grpc_port, http_port, metrics_port = _free_ports(3)
    c = Container(engine, f"tandem-smoke-{uuid.uuid4().hex[:8]}")
    try:
        c.run("run", "-d", "--name", c.name, "--network", "host", *_ulimits(), image, "serve", "--host", "127.0.0.1",
              "--port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port),
              "--device", "cpu", "--drain-timeout", str(DRAIN_TIMEOUT))
        client = TandemClient(f"127.0.0.1:{grpc_port}")
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert c.running(), "the container exited while starting:\n" + c.logs()[-4000:]
            try:
                client.wait_ready(5)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "not ready in time:\n" + c.logs()[-4000:]
        c.grpc, c.http, c.client = f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", client
        yield c
        client.close()
    finally:
        c.run("kill", c.name, check=False)
        c.run("rm", "--force", c.name, check=False)


def test_image_runs_the_embedded_model_as_the_manifests_user(served):
    assert re.search(r"Tandem is serving /opt/tandem/models/tandem-tiny ", served.logs())
    assert served.run("exec", served.name, "id", "-u").stdout.strip() == UID


def test_both_health_services_report_serving(served):
    with grpc.insecure_channel(served.grpc) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "tandem.v1.Tandem"):
            got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert got == health_pb2.HealthCheckResponse.SERVING, service
    with urllib.request.urlopen(served.http + "/health", timeout=10) as r:
        assert r.status == 200


def test_grpc_and_http_answer_from_outside(served):
    from openai import OpenAI

    prompt, n = "The capital of France is", 8
    got = served.client.generate_unary(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                       timeout=120)
    assert got.completion_tokens == n and len(got.token_ids) == n
    assert got.finish_reason == common_pb2.FINISH_REASON_LENGTH
    api = OpenAI(base_url=served.http + "/v1", api_key="unused", timeout=120, max_retries=0)
    (model,) = [m.id for m in api.models.list()]
    http = api.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert http.usage.completion_tokens == n and http.choices[0].finish_reason == "length"
    assert http.choices[0].text == got.text  # greedy: both front ends return the same continuation


def test_manifest_flags_exist_in_the_image(engine, image):
    """The overlays' container command lines against the image's own `tandem <role> --help`."""
    roles = ("router", "prefill-worker", "decode-worker")
    script = "; ".join(f"tandem {r} --help; echo '=== end of {r}'" for r in roles)
    out = subprocess.run([*engine, "run", "--rm", "--network", "none", *_ulimits(), "--entrypoint", "sh", image,
                          "-c", script], capture_output=True, text=True, timeout=180, check=True).stdout
    helps = dict(zip(roles, re.split(r"=== end of \S+\n", out)))
    for overlay in OVERLAYS:
        for role, dep in deployments(overlay).items():
            c = container(dep)
            unknown = manifest_flags(c) - help_flags(helps[c["command"][1]])
            assert not unknown, (overlay, role, unknown)


def test_sigterm_drains_the_request_in_flight(served):
    """Runs last in this module: it stops the container."""
    n = 400
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    first, received, finish = threading.Event(), [], []

    def consume():
        for msg in served.client.generate("Tell me a long story.", params, timeout=DRAIN_TIMEOUT + 60):
            received.extend(msg.token_ids)
            first.set()
            if msg.finish_reason:
                finish.append(msg.finish_reason)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    assert first.wait(60), "no token within 60 s"
    in_flight_at_signal = len(received)
    served.run("kill", "--signal", "TERM", served.name)
    t0 = time.monotonic()
    code = served.run("wait", served.name, timeout=DRAIN_TIMEOUT + 30).stdout.strip()
    took = time.monotonic() - t0
    t.join(10)
    assert in_flight_at_signal < n, "the request finished before the signal; lengthen it"
    assert len(received) == n and finish == [common_pb2.FINISH_REASON_LENGTH], (len(received), finish)
    assert code == "0", served.logs()[-4000:]
    assert took < DRAIN_TIMEOUT + 10, took
