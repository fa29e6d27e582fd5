"""`tandem decode-worker`: one decode worker process (gRPC service + hand-off listener). It also serves the
PrefillWorker service's Prefill for its own leases, which a router without prefill workers uses (colocated)."""

from __future__ import annotations

import logging

from decode_worker.server import DecodeWorker
from tandem.engine.engine import Engine
from tandem.structured import GrammarCompiler
from tandem.rpc import worker_pb2, worker_pb2_grpc
from tandem.rpc.auth import internal_auth
from tandem.rpc.server import Server, Tls, add_tls_args
from tandem.worker_setup import (add_engine_args, add_server_args, advertise_host, announce, build_worker_model,
                                 engine_config, fingerprint, internal_token, prepare_engine, require_free_ports,
                                 serve_until_signalled, start_metrics, stop_worker_model)


def add_args(ap) -> None:
    add_engine_args(ap)
    add_server_args(ap, port=50062)
    ap.add_argument("--transfer-port", type=int, default=50063, help="hand-off listener port (0: any free port)")
    ap.add_argument("--lease-seconds", type=float, default=60.0,
                    help="how long a lease lives without a renewal (the router renews it while the request waits "
                    "for and undergoes its prefill), and then waits for its stream")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="send a request's tokens once this many have come (and when it ends), not after every "
                    "step: fewer messages a step for the worker's threads to send, burstier streams")
    add_tls_args(ap)


def main(args) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s decode %(levelname)s %(message)s")
    require_free_ports(args.host, {"gRPC": args.port, "metrics": args.metrics_port, "hand-off": args.transfer_port})
    token = internal_token(args, "decode")
    ecfg = engine_config(args)
    cfg, model, _ = build_worker_model(args, ecfg)
    metrics, metrics_address = start_metrics(args, "decode")
    tls = Tls.from_args(args)
    engine = Engine(cfg, model, ecfg)
    engine.grammars = GrammarCompiler(args.model, cfg.vocab_size, cfg.eos_token_ids)
    prepare_engine(engine)  # it may prefill too (colocated serving)
    worker = DecodeWorker(engine, fingerprint(args), args.host, args.transfer_port,
                          advertise_host(args), lease_seconds=args.lease_seconds, metrics=metrics,
                          stream_interval=args.stream_interval,
                          ssl_context=tls.server_context() if tls else None).start()
    server = Server(tls=tls, interceptors=[internal_auth(token)] if token else [])
    server.add(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, worker,
               worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name)
    server.add(worker_pb2_grpc.add_PrefillWorkerServicer_to_server, worker,  # colocated: Prefill of its own leases
               worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name)
    port = server.start(args.host, args.port)
    announce("decode-worker", grpc=f"{advertise_host(args)}:{port}", transfer=worker.transfer_address,
             metrics=metrics_address)
    serve_until_signalled(server, worker, args.drain_timeout)
    stop_worker_model(model)
    return 1 if worker.loop.fatal_error else 0  # a supervisor restarts a worker that could not go on
