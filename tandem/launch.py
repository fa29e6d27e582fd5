"""`tandem serve`: router + N prefill + M decode workers as local processes, stopped together. With N = 0 the
router is colocated: each decode worker prefills the requests it leased itself (no hand-off), so a model that
fits only once on a GPU is served through the same router, gRPC and HTTP stack.

Each worker listens on a free port and announces it on stdout (`TANDEM <role> grpc=... `); the router is
started once every worker has announced itself. Ctrl-C or SIGTERM drains and stops the router first, then the
workers; a child that does not stop in time is killed. If any child dies, everything is stopped.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time

import torch

from tandem.client import TandemClient
from tandem.ops.gdn import prefill_kernel
from tandem.parallel import check_divisible
from tandem.rpc.auth import INTERNAL_TOKEN_ENV, load_secret
from tandem.model.source import model_config
from tandem.worker_setup import StopSignal, require_free_ports, resolve_engine_args

START_TIMEOUT = 300.0


class Child:
    """env: variables added to this process's environment for the child (secrets: never on a command line)."""

    def __init__(self, name: str, argv: list[str], own_session: bool = False, env: dict[str, str] | None = None):
        self.name, self.argv, self.env = name, argv, dict(env or {})
        self.announced: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env),
                                     start_new_session=own_session)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        """Forwards the child's output, prefixed; hands its announcement line to whoever waits for it."""
        for line in self.proc.stdout:
            if line.startswith("TANDEM "):
                words = line.split()
                self.announced.put(dict([kv.split("=", 1) for kv in words[2:]], _kind=words[1]))
            else:
                sys.stderr.write(f"[{self.name}] {line}")

    def wait_announced(self, deadline: float) -> dict:
        while True:
            try:
                return self.announced.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was "
                                       "ready") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} was not ready within {START_TIMEOUT:.0f} s") from None


def _engine_argv(args) -> list[str]:
    argv = ["--model", args.model, "--dtype", args.dtype, "--seed", str(args.seed), "--max-model-len",
            str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--block-size", str(args.block_size),
            "--num-speculative-tokens", str(args.num_speculative_tokens), "--log-level", args.log_level,
            "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
            "--prefix-state-interval", str(args.prefix_state_interval)]
    if args.num_kv_blocks:
        argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.kv_cache_memory_bytes:
        argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    if args.emulated_acceptance:
        argv += ["--emulated-acceptance", args.emulated_acceptance]
    return argv


def _worker_device(args, index: int, gpus: int) -> str:
    """Worker `index`'s device (--device, else a GPU, else the CPU). Under tensor parallelism its ranks take
    consecutive GPUs from there (`rank_device`): the workers go round robin over whole groups of GPUs."""
    if args.device or not gpus:
        return args.device or "cpu"
    tp = args.tensor_parallel_size
    if tp > gpus:
        raise RuntimeError(f"--tensor-parallel-size {tp} needs {tp} GPUs per worker; this host has {gpus}")
    return f"cuda:{(index % (gpus // tp)) * tp}"


def _tls_argv(args) -> list[str]:
    return [*(["--tls-cert", args.tls_cert, "--tls-key", args.tls_key] if args.tls_cert else []),
            *(["--tls-ca", args.tls_ca] if args.tls_ca else [])]


def _fault_for(fault: str | None, index: int) -> str | None:
    """`FAULT` applies to every prefill worker, `FAULT@i` to prefill worker i only (a fault on one of several)."""
    if not fault:
        return None
    name, _, only = fault.partition("@")
    return name if not only or int(only) == index else None


RESTART_ATTEMPTS, RESTART_PAUSE = 3, 2.0


def _restart(child: "Child", ann: dict) -> "Child":
    """The same worker again on the same ports (gRPC, hand-off, metrics), so the router's address for it and the
    announced metrics address stay valid; ready when this returns. A port of the dead worker can stay taken for a
    moment after its death (a CPU suite run saw the restarted worker fail to bind it once), so a start that fails
    is tried again, RESTART_ATTEMPTS times in all, before the RuntimeError is passed on."""
    argv = list(child.argv)
    argv[argv.index("--port") + 1] = ann["grpc"].rsplit(":", 1)[1]
    for key, flag in (("transfer", "--transfer-port"), ("metrics", "--metrics-port")):
        if key in ann:
            argv[argv.index(flag) + 1] = ann[key].rsplit(":", 1)[1]
    for attempt in range(1, RESTART_ATTEMPTS + 1):
        new = Child(child.name, argv, env=child.env)
        try:
            new.wait_announced(time.monotonic() + START_TIMEOUT)
            return new
        except RuntimeError as e:
            new.proc.kill()  # not ready in time: it must not hold the ports for the next attempt
            new.proc.wait()
            if attempt == RESTART_ATTEMPTS:
                raise
            print(f"{e}; starting it again in {RESTART_PAUSE:.0f} s", file=sys.stderr)
            time.sleep(RESTART_PAUSE)


def serve(args) -> int:
    from router.chat_parsers import parser_argv
    from router.cors import cors_argv
    from router.routing import RoutingConfig, routing_argv

    if args.decode_workers < 1 or args.prefill_workers < 0:
        print("error: --decode-workers must be at least 1 and --prefill-workers at least 0", file=sys.stderr)
        return 2
    try:  # before any process starts: the worker would only fail in its model load, the router at its start
        check_divisible(model_config(args.model), args.tensor_parallel_size)
        RoutingConfig.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    colocated = args.prefill_workers == 0
    if colocated and args.inject_fault:
        print("error: --inject-fault applies to prefill workers; there are none (--prefill-workers 0)",
              file=sys.stderr)
        return 2
    # the router's fixed ports: a taken one fails now, not after the workers have loaded the model
    require_free_ports(args.host, {"gRPC": args.port, "HTTP": args.http_port,
                                   "metrics": args.metrics_port if args.metrics else None})
    # the router's credential on the workers' services: from the flag or environment, else new for this launch
    token = load_secret(args.internal_token_file, INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(32)
    internal = {INTERNAL_TOKEN_ENV: token}
    gpus = torch.cuda.device_count()
    children: list[Child] = []
    stopping = StopSignal()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        # the router and every worker get the same dtype and limits: those of the first worker's device
        resolve_engine_args(args, _worker_device(args, 0, gpus))
        workers = {"prefill": [], "decode": []}
        for role, n in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
            for i in range(n):
                device = _worker_device(args, len(children), gpus)
                argv = [f"{role}-worker", *_engine_argv(args), "--device", device, "--host", args.host, "--port", "0",
                        "--worker-name", f"{role}-{i}", "--drain-timeout", str(args.drain_timeout),
                        *(["--metrics-port", "0"] if args.metrics else []), *_tls_argv(args)]
                if role == "decode":
                    argv += ["--transfer-port", "0"]
                    if args.lease_seconds is not None:
                        argv += ["--lease-seconds", str(args.lease_seconds)]
                    if args.stream_interval is not None:
                        argv += ["--stream-interval", str(args.stream_interval)]
                else:
                    argv += ["--transfer-backend", args.transfer_backend]
                    if args.max_queued_prompt_tokens is not None:
                        argv += ["--max-queued-prompt-tokens", str(args.max_queued_prompt_tokens)]
                    if _fault_for(args.inject_fault, i):
                        argv += ["--inject-fault", _fault_for(args.inject_fault, i)]
                children.append(Child(f"{role}-{i}", argv, env=internal))
                workers[role].append(children[-1])
        announced = {role: [c.wait_announced(deadline) for c in cs] for role, cs in workers.items()}
        addresses = {role: [a["grpc"] for a in anns] for role, anns in announced.items()}
        router = Child("router", ["router", "--model", args.model, "--max-model-len", str(args.max_model_len),
                                  "--num-speculative-tokens", str(args.num_speculative_tokens), "--host", args.host,
                                  "--port", str(args.port), "--log-level", args.log_level, "--worker-name", "router",
                                  *(["--served-model-name", args.served_model_name] if args.served_model_name else []),
                                  *(["--api-key-file", args.api_key_file] if args.api_key_file else []),
                                  "--drain-timeout", str(args.drain_timeout), *_tls_argv(args),
                                  *(["--max-queued-requests", str(args.max_queued_requests)]
                                    if args.max_queued_requests is not None else []),
                                  *(["--decode-failover"] if args.decode_failover else []),
                                  *(["--poll-seconds", str(args.poll_seconds)] if args.poll_seconds else []),
                                  *(["--metrics-port", str(args.metrics_port)] if args.metrics else []),
                                  *(["--http-port", str(args.http_port)] if args.http_port is not None else []),
                                  *cors_argv(args), *parser_argv(args), *routing_argv(args),
                                  # no prefill workers: the router is colocated
                                  *(["--prefill-workers", ",".join(addresses["prefill"])] if not colocated else []),
                                  "--decode-workers", ",".join(addresses["decode"])], env=internal)
        children.insert(0, router)
        at = router.wait_announced(deadline)
        where = at["grpc"]
        metrics = [a["metrics"] for a in [at, *announced["prefill"], *announced["decode"]] if "metrics" in a]
        http = f" and http://{at['http']}/v1" if "http" in at else ""
        mode = (f"colocated: the decode workers prefill their own requests; decode workers: "
                f"{', '.join(addresses['decode'])}" if colocated else
                f"disaggregated: prefill workers: {', '.join(addresses['prefill'])}; decode workers: "
                f"{', '.join(addresses['decode'])}")
        print(f"Tandem is serving {args.model} at grpc://{where}{http}  ({mode}). Ctrl-C stops.", flush=True)
        print(prefill_kernel(_worker_device(args, 0, gpus)), flush=True)
        if metrics:
            print(f"Prometheus metrics: {', '.join(f'http://{m}/metrics' for m in metrics)}", flush=True)
        # pids and addresses per worker: fault tests kill one by pid and find it again after a restart
        ann = {c.name: a for c, a in zip([*workers["prefill"], *workers["decode"]],
                                         [*announced["prefill"], *announced["decode"]])}
        pids = ",".join(f"{c.name}:{c.proc.pid}" for c in children)
        print(f"TANDEM serve grpc={where} mode={'colocated' if colocated else 'disaggregated'}"
              + (f" metrics={','.join(metrics)}" if metrics else "")
              + (f" http={at['http']}" if "http" in at else "") + f" pids={pids}"
              + " workers=" + ",".join(f"{n}@{a['grpc']}" for n, a in ann.items()), flush=True)
        while not stopping.wait(0.2):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead and args.restart_workers and dead[0] is not router:
                # supervisor mode: a dead worker comes back on its ports; the router's poll finds it healthy again
                c = dead[0]
                print(f"{c.name} exited with code {c.proc.returncode}; restarting", file=sys.stderr)
                try:
                    new = _restart(c, ann[c.name])
                except RuntimeError as e:
                    print(f"error: {e}; stopping", file=sys.stderr)
                    return 1
                children[children.index(c)] = new
                print(f"TANDEM restarted name={c.name} pid={new.proc.pid} grpc={ann[c.name]['grpc']}"
                      + (f" metrics={ann[c.name]['metrics']}" if "metrics" in ann[c.name] else ""), flush=True)
                continue
            if dead:
                print(f"{dead[0].name} exited with code {dead[0].proc.returncode}; stopping", file=sys.stderr)
                return 1
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_all(children, args.drain_timeout)


def _stop_all(children: list[Child], drain_timeout: float) -> None:
    """Router first (it drains its requests), then the workers; kill whatever outlives its grace."""
    for group in (children[:1], children[1:]):
        for c in group:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + drain_timeout + 5
        for c in group:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


def add_args(ap) -> None:
    from router.chat_parsers import add_parser_args
    from router.cors import add_cors_args
    from router.routing import add_routing_args
    from tandem.transfer.kinds import BACKENDS
    from tandem.worker_setup import add_engine_args

    add_engine_args(ap)
    ap.add_argument("--served-model-name", default=None, help="the model's name in the API and in metrics")
    ap.add_argument("--api-key-file", default=None, help="the router's API key (default: $TANDEM_API_KEY; unset: none)")
    ap.add_argument("--internal-token-file", default=None, help="the token the router presents to the workers "
                    "(default: $TANDEM_INTERNAL_TOKEN; unset: a new random one per launch)")
    ap.add_argument("--prefill-workers", type=int, default=1,
                    help="prefill worker processes; 0: colocated serving, each decode worker prefills its own "
                    "requests (no hand-off; for a model that fits only once per GPU)")
    ap.add_argument("--decode-workers", type=int, default=1, help="decode worker processes")
    ap.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    ap.add_argument("--port", type=int, default=50051, help="the router's gRPC port (0: any free port)")
    ap.add_argument("--transfer-backend", default="auto", choices=("auto", *BACKENDS),
                    help="how prefill workers send the KV cache and GDN states to decode workers (auto: cuda_ipc on "
                    "one GPU host, else torch_distributed on GPUs, tcp on CPUs)")
    ap.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight work gets on SIGTERM")
    ap.add_argument("--metrics-port", type=int, default=9090, help="the router's /metrics port (workers take free "
                    "ports; all are printed)")
    ap.add_argument("--no-metrics", dest="metrics", action="store_false", help="serve no /metrics")
    ap.add_argument("--http-port", type=int, default=8000, help="the router's OpenAI-compatible HTTP port")
    add_cors_args(ap)
    add_parser_args(ap)
    add_routing_args(ap)
    ap.add_argument("--log-level", default="WARNING", help="every process's log level (DEBUG, INFO, WARNING, ...)")
    ap.add_argument("--inject-fault", default=None, help="testing only (passed to the prefill workers; FAULT@i: "
                    "prefill worker i only)")
    ap.add_argument("--lease-seconds", type=float, default=None, help="the decode workers' --lease-seconds")
    ap.add_argument("--max-queued-prompt-tokens", type=int, default=None,
                    help="the prefill workers' --max-queued-prompt-tokens")
    ap.add_argument("--stream-interval", type=int, default=None, help="the decode workers' --stream-interval")
    ap.add_argument("--restart-workers", action="store_true",
                    help="restart a worker that dies, on the same ports (default: a dead child stops everything)")
    ap.add_argument("--max-queued-requests", type=int, default=None, help="the router's --max-queued-requests")
    ap.add_argument("--decode-failover", action="store_true", help="the router's --decode-failover")
    ap.add_argument("--poll-seconds", type=float, default=None, help="the router's --poll-seconds")
    ap.add_argument("--tls-cert", default=None, help="PEM certificate of every process (TLS on every gRPC link)")
    ap.add_argument("--tls-key", default=None, help="PEM key for --tls-cert")
    ap.add_argument("--tls-ca", default=None, help="PEM CA: peers must present a certificate it signed (mTLS)")


class ServeProcess:
    """`tandem serve` in a subprocess (its own session, so a kill reaches every child), ready when constructed;
    for tests and benchmarks. `internal_token`: the one its workers require (tests call them directly with it)."""

    def __init__(self, *flags: str, start_timeout: float = 180.0, api_key: str | None = None, tls=None):
        self.internal_token = secrets.token_urlsafe(16)
        self.child = Child("serve", ["serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                                     "--http-port", "0", *flags], own_session=True,
                           env={INTERNAL_TOKEN_ENV: self.internal_token})
        self.proc = self.child.proc
        try:
            at = self.child.wait_announced(time.monotonic() + start_timeout)
        except RuntimeError:
            self.stop()
            raise
        self.address = at["grpc"]
        self.metrics = at.get("metrics", "").split(",")  # router first, then prefill, then decode workers
        self.http = at.get("http")
        self.pids = dict(kv.rsplit(":", 1) for kv in at.get("pids", "").split(",") if kv)  # name -> pid (str)
        self.pids = {k: int(v) for k, v in self.pids.items()}
        self.workers = dict(kv.split("@", 1) for kv in at.get("workers", "").split(",") if kv)  # name -> grpc
        self.client = TandemClient(self.address, api_key, tls=tls)
        self.client.wait_ready(60)

    def wait_restarted(self, name: str, timeout: float = 120.0) -> int:
        """After a worker was killed under --restart-workers: waits for its announcement; returns the new pid."""
        deadline = time.monotonic() + timeout
        while True:
            ev = self.child.wait_announced(deadline)
            if ev.get("_kind") == "restarted" and ev.get("name") == name:
                self.pids[name] = int(ev["pid"])
                return self.pids[name]

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
        """Until every worker is healthy and reports nothing in use (blocks, slots, leases, requests); returns the
        last report."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.client.server_info()
            busy = [w for w in info.workers
                    if not w.healthy or w.load.free_kv_blocks != w.load.total_kv_blocks or w.load.active_leases
                    or w.load.free_state_slots != w.load.total_state_slots or w.load.running_requests
                    or w.load.waiting_requests]
            if not busy or time.monotonic() > deadline:
                return info
            time.sleep(0.1)
