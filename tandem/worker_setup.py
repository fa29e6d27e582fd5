"""What every server process shares: engine flags, building the engine, the model fingerprint, and running a
gRPC server until SIGTERM/SIGINT with a drain (readiness off, no new work, in-flight work finishes)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import time

import torch

from tandem.config import EngineConfig
from tandem.model.presets import PRESETS
from tandem.model.source import model_config
from tandem.rpc.auth import INTERNAL_TOKEN_ENV, load_secret

log = logging.getLogger(__name__)

# The embedded default: the trained tandem-tiny checkpoint of this repository (a random-weight preset when the
# package is installed without it).
_REPO_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "tandem-tiny")
DEFAULT_MODEL = _REPO_MODEL if os.path.isdir(_REPO_MODEL) else "tiny-moe"
# Defaults that depend on the device. On a CPU the caches are sized for max_num_seqs full-length requests unless
# --kv-cache-memory-bytes says otherwise, so its max_model_len stays short.
CPU_MAX_MODEL_LEN, CPU_MAX_NUM_SEQS, GPU_MAX_NUM_SEQS = 4096, 64, 256


def add_engine_args(ap) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or preset name")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: the checkpoint's dtype on a GPU (bfloat16 for a preset), float32 on a CPU")
    ap.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help=f"longest prompt + output in tokens (default: the checkpoint's max_position_embeddings on a "
                    f"GPU; at most {CPU_MAX_MODEL_LEN} on a CPU)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help=f"most requests running at once (default: {GPU_MAX_NUM_SEQS} on a GPU, {CPU_MAX_NUM_SEQS} "
                    "on a CPU; lowered to the GDN state slots that fit)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="tokens one engine step processes at most (decode rows first, then prompt chunks)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="share of the GPU's memory this worker may use: what the weights and the largest step "
                    "leave of it goes to the KV blocks and GDN state slots")
    ap.add_argument("--kv-cache-memory-bytes", type=memory_bytes, default=None,
                    help="bytes for the KV blocks and GDN state slots (e.g. 8Gi, 500M), instead of "
                    "--gpu-memory-utilization; the way to size the caches on a CPU")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV blocks (the null block included), overriding the sizes above")
    ap.add_argument("--num-speculative-tokens", type=int, default=2, help="MTP drafts per step (0: off)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="share the KV blocks and GDN states of repeated prompt prefixes between requests")
    ap.add_argument("--prefix-state-interval", type=int, default=2048,
                    help="with prefix caching: tokens between GDN state snapshots in a long prompt (a multiple "
                    "of --block-size); prompts also snapshot at their end and where they leave a cached prefix")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs for decode or prefill steps (debugging)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks per worker, heads and experts split across them (processes of their own; on a GPU "
                    "one per rank, from --device on; CUDA graphs are off under TP)")
    ap.add_argument("--emulated-acceptance", default=None,
                    help="benchmarks only: comma-separated acceptance probability per draft position")


def add_server_args(ap, port: int) -> None:
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    ap.add_argument("--port", type=int, default=port, help="gRPC port (0: any free port)")
    ap.add_argument("--advertise-host", default=None, help="host others use to reach this process "
                    "(default: --host, or the pod IP when listening on 0.0.0.0)")
    ap.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight work gets on SIGTERM")
    ap.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: any free port; "
                    "default: none)")
    ap.add_argument("--served-model-name", default=None, help="the model's name in the API and in metrics "
                    "(default: the --model directory's or preset's name)")
    ap.add_argument("--worker-name", default=None, help="the `worker` label of this process's metrics "
                    "(default: role-pid; the pod name in Kubernetes)")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    ap.add_argument("--internal-token-file", default=None, help="file holding the token the router sends and the "
                    "workers require on their gRPC services (default: $TANDEM_INTERNAL_TOKEN; unset: workers accept "
                    "any caller unless mTLS is on)")


def internal_token(args, role: str) -> str | None:
    """This process's internal token (--internal-token-file, else $TANDEM_INTERNAL_TOKEN); a worker without one
    and without mTLS says that it serves anyone who reaches its port."""
    token = load_secret(args.internal_token_file, INTERNAL_TOKEN_ENV)
    if token is None and role != "router" and not getattr(args, "tls_ca", None):
        log.warning("no internal token (--internal-token-file or $%s) and no mTLS (--tls-ca): this %s worker "
                    "accepts calls from anyone who reaches its gRPC port", INTERNAL_TOKEN_ENV, role)
    return token


def require_free_ports(host: str, ports: dict[str, int | None]) -> None:
    """Exits with a one-line error when one of `ports` ({what: port}; 0 and None are skipped) cannot be listened
    on, before anything is loaded. The servers also refuse to share a port; this says so early, and by name."""
    for what, port in ports.items():
        if not port:
            continue
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError as e:
                raise SystemExit(f"error: cannot listen on {host}:{port} ({what}): {e.strerror}") from None


def memory_bytes(text: str) -> int:
    """'8589934592', '8G' (10^9) or '8Gi' (2^30); K, M, T likewise."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    t = text.strip().upper().removesuffix("B")
    digits = t.rstrip("KMGTI")
    try:
        return int(float(digits) * units[t[len(digits):]])
    except (ValueError, KeyError):
        raise ValueError(f"not a size in bytes: {text!r}") from None


def resolve_engine_args(args, device: str | None = None) -> None:
    """Fills the engine flags left to their defaults (--dtype auto, --max-model-len, --max-num-seqs) in place,
    from the device (`device`, else --device, else cuda when available) and the checkpoint, so that whatever
    reads args afterwards (the fingerprint, the router's limits) sees what the engine gets."""
    device = device or args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    if args.dtype == "auto":
        args.dtype = checkpoint_dtype(args.model) if gpu else "float32"
    if args.max_model_len is None:
        native = model_config(args.model).max_position_embeddings
        args.max_model_len = native if gpu else min(CPU_MAX_MODEL_LEN, native)
    if args.max_num_seqs is None:
        args.max_num_seqs = GPU_MAX_NUM_SEQS if gpu else CPU_MAX_NUM_SEQS


def checkpoint_dtype(model: str) -> str:
    """The dtype a checkpoint's config.json names (`torch_dtype`, or `dtype`); bfloat16 for a preset."""
    if not os.path.isdir(model):
        return "bfloat16"
    with open(os.path.join(model, "config.json")) as f:
        raw = json.load(f)
    for part in (raw, raw.get("text_config") or {}):
        name = part.get("torch_dtype") or part.get("dtype")
        if name in ("float32", "bfloat16", "float16"):
            return name
    return "bfloat16"


def engine_config(args) -> EngineConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    resolve_engine_args(args, device)
    return EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype, device=device,
                        cuda_graphs=False if args.enforce_eager else None,
                        enable_prefix_caching=args.enable_prefix_caching,
                        prefix_state_interval=args.prefix_state_interval,
                        emulated_acceptance=tuple(float(r) for r in args.emulated_acceptance.split(","))
                        if args.emulated_acceptance else None)


def build_worker_model(args, ecfg: EngineConfig):
    """The worker's model (cfg, model, model_dir): with --tensor-parallel-size N, ranks 1..N-1 are started as
    processes of their own (`stop_worker_model` stops them; so does this process's exit)."""
    from tandem.engine.llm import build_model
    from tandem.ops.gdn import prefill_kernel

    built = build_model(args.model, ecfg, args.seed, args.tensor_parallel_size)
    log.info("%s", prefill_kernel(ecfg.device))
    return built


def stop_worker_model(model) -> None:
    """Stops the other tensor-parallel ranks (nothing to do on one rank)."""
    from tandem.engine.tensor_parallel import LeaderModel

    if isinstance(model, LeaderModel):
        model.shutdown()


def prepare_engine(engine) -> None:
    """Before a worker serves: on a GPU, compile the prefill kernels and capture the decode graphs now, so the
    first requests do not wait for them."""
    if engine.ecfg.device.startswith("cuda"):
        engine.warm_up()
        engine.capture_graphs()
        name_late_kernel_variants()


def name_late_kernel_variants() -> None:
    """From now on, each Triton kernel variant this process loads for the first time (a compile of seconds, or a
    read of Triton's cache) is logged with its specialisation: a served step waited for it, and the warm-up should
    have reached it. The loop's "slow engine step" warning says that a step was slow; this says which kernel."""
    try:
        from triton import knobs
    except ImportError:  # no Triton (or one without knobs): nothing to name
        return

    def named(**kw):
        log.warning("Triton loaded a kernel variant while serving (the warm-up missed it): %s, constants %s",
                    kw.get("repr"), kw.get("compile", {}).get("constants"))

    knobs.runtime.jit_post_compile_hook = named


def fingerprint(args) -> str:
    """Same on a prefill and a decode worker exactly when their caches mean the same thing. Not the
    tensor-parallel size: hand-offs carry the full model's state whatever either side's (`tandem/cache/handoff.py`)."""
    from tandem.transfer.manifest import model_fingerprint

    if os.path.isdir(args.model):
        with open(os.path.join(args.model, "config.json")) as f:
            raw, model_id = json.load(f), os.path.basename(os.path.normpath(args.model))
    else:
        raw, model_id = PRESETS[args.model], f"{args.model}@seed{args.seed}"
    return model_fingerprint(raw, args.dtype, args.block_size, model_id)


def advertise_host(args) -> str:
    if args.advertise_host:
        return args.advertise_host
    if args.host in ("0.0.0.0", "::", ""):
        return os.environ.get("POD_IP") or "127.0.0.1"
    return args.host


def served_model_name(args) -> str:
    return args.served_model_name or os.path.basename(os.path.normpath(args.model))


def start_metrics(args, role: str):
    """This process's Metrics, served at /metrics when --metrics-port is given; returns (metrics, address)."""
    from tandem.metrics import Metrics

    metrics = Metrics(served_model_name(args), args.worker_name or f"{role}-{os.getpid()}", role=role)
    if args.metrics_port is None:
        return metrics, None
    server, _ = metrics.start_http_server(args.metrics_port, args.host)
    return metrics, f"{advertise_host(args)}:{server.server_port}"


def announce(role: str, **addresses) -> None:
    """The line `tandem serve` (and people) read to learn where a process listens."""
    print(f"TANDEM {role} " + " ".join(f"{k}={v}" for k, v in addresses.items() if v), flush=True)


class StopSignal:
    """Notes SIGTERM/SIGINT. The handler only sets a flag: a `threading.Event.set()` there deadlocks when the
    signal lands while the main thread holds that Event's lock inside its own `wait` (a launcher that polled an
    Event and so never passed a SIGTERM on)."""

    def __init__(self):
        self.received = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._receive)

    def _receive(self, *_) -> None:
        self.received = True

    def wait(self, timeout: float) -> bool:
        """Whether a signal came, after sleeping `timeout` unless one had (a signal does not cut a sleep short:
        Python resumes it after the handler), so the poll interval bounds how late a signal is acted on."""
        if not self.received:
            time.sleep(timeout)
        return self.received


def serve_until_signalled(server, service, drain_timeout: float) -> None:
    """Blocks until SIGTERM/SIGINT; then drains: readiness off and `service.draining` set (new work is refused
    with UNAVAILABLE), waits while `service.busy()` for at most `drain_timeout`, stops the server and the service."""
    stop = StopSignal()
    while not stop.wait(0.2):
        pass
    log.info("draining (at most %.0f s)", drain_timeout)
    service.draining = True
    server.set_serving(False)
    deadline = time.monotonic() + drain_timeout
    while service.busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(grace=1.0)
    service.stop()
