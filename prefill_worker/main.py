"""`tandem prefill-worker`: one prefill worker process."""

from __future__ import annotations

import logging

import torch

from prefill_worker.server import DEFAULT_MAX_QUEUED_PROMPT_TOKENS, FAULTS, PrefillWorker
from tandem.engine.engine import Engine
from tandem.structured import GrammarCompiler
from tandem.rpc import worker_pb2, worker_pb2_grpc
from tandem.rpc.auth import internal_auth
from tandem.rpc.server import Server, Tls, add_tls_args
from tandem.transfer.kinds import BACKENDS
from tandem.worker_setup import (add_engine_args, add_server_args, advertise_host, announce, build_worker_model,
                                 engine_config, fingerprint, internal_token, prepare_engine, require_free_ports,
                                 serve_until_signalled, start_metrics, stop_worker_model)


def add_args(ap) -> None:
    add_engine_args(ap)
    add_server_args(ap, port=50061)
    ap.add_argument("--transfer-backend", default="auto", choices=("auto", *BACKENDS),
                    help="how the state goes to decode workers (auto: by device and host)")
    ap.add_argument("--max-queued-prompt-tokens", type=int, default=None,
                    help="prompt tokens that may wait here (received, not yet prefilled); a prompt beyond is refused "
                    "at once (RESOURCE_EXHAUSTED, HTTP 429), and the router tries another prefill worker (default: "
                    f"about 30 s of prefill: {DEFAULT_MAX_QUEUED_PROMPT_TOKENS['cpu']} on a CPU, "
                    f"{DEFAULT_MAX_QUEUED_PROMPT_TOKENS['cuda']} on a GPU)")
    ap.add_argument("--inject-fault", default=None, choices=FAULTS, help="testing only")
    add_tls_args(ap)


def main(args) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s prefill %(levelname)s %(message)s")
    require_free_ports(args.host, {"gRPC": args.port, "metrics": args.metrics_port})
    token = internal_token(args, "prefill")
    ecfg = engine_config(args)
    cfg, model, _ = build_worker_model(args, ecfg)
    backend = args.transfer_backend
    if backend == "auto":
        backend = "tcp" if ecfg.device == "cpu" else "cuda_ipc"
    metrics, metrics_address = start_metrics(args, "prefill")
    tls = Tls.from_args(args)
    engine = Engine(cfg, model, ecfg, prefill_only=True)
    engine.grammars = GrammarCompiler(args.model, cfg.vocab_size, cfg.eos_token_ids)
    prepare_engine(engine)
    worker = PrefillWorker(engine, fingerprint(args), backend,
                           args.inject_fault, metrics, ssl_context=tls.client_context() if tls else None,
                           max_queued_prompt_tokens=args.max_queued_prompt_tokens
                           or DEFAULT_MAX_QUEUED_PROMPT_TOKENS[torch.device(ecfg.device).type]).start()
    server = Server(tls=tls, interceptors=[internal_auth(token)] if token else [])
    server.add(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, worker,
               worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name)
    port = server.start(args.host, args.port)
    announce("prefill-worker", grpc=f"{advertise_host(args)}:{port}", transfer_backend=backend,
             metrics=metrics_address)
    serve_until_signalled(server, worker, args.drain_timeout)
    stop_worker_model(model)
    return 1 if worker.loop.fatal_error else 0  # a supervisor restarts a worker that could not go on
