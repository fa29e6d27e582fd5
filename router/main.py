"""`tandem router`: the public gRPC endpoint in front of the prefill and decode workers (or, colocated, of
decode workers alone, each prefilling the requests it leased)."""

from __future__ import annotations

import logging

from router.auth import ApiKeyInterceptor, load_api_key
from router.chat_parsers import Parsers, add_parser_args
from router.cors import Cors, add_cors_args
from router.routing import RoutingConfig, add_routing_args
from router.server import Router
from router.workers import WorkerPool
from tandem.rpc import router_pb2, router_pb2_grpc
from tandem.rpc.server import Server, Tls, add_tls_args
from tandem.model.source import model_config
from tandem.tokenizer import load_tokenizer_for
from tandem.worker_setup import (DEFAULT_MODEL, add_server_args, advertise_host, announce, internal_token,
                                 require_free_ports, serve_until_signalled, served_model_name,
                                 start_metrics)

log = logging.getLogger(__name__)


def _list(s: str | None) -> list[str]:
    return [a for a in (s or "").split(",") if a]


def add_args(ap) -> None:
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or preset name (as the workers')")
    ap.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens (default: "
                    "the shortest the workers report)")
    ap.add_argument("--num-speculative-tokens", type=int, default=2, help="the workers' MTP drafts per step")
    add_server_args(ap, port=50051)
    ap.add_argument("--prefill-workers", default=None, help="comma-separated host:port list; with neither this nor "
                    "--prefill-dns the router is colocated: each decode worker prefills the requests it leased")
    ap.add_argument("--decode-workers", default=None, help="comma-separated host:port list")
    ap.add_argument("--prefill-dns", default=None, help="name:port re-resolved for prefill workers (headless Service)")
    ap.add_argument("--decode-dns", default=None, help="name:port re-resolved for decode workers (headless Service)")
    ap.add_argument("--poll-seconds", type=float, default=1.0, help="worker discovery and health-check period")
    ap.add_argument("--http-port", type=int, default=None,
                    help="OpenAI-compatible HTTP port (0: any free port; default: no HTTP)")
    ap.add_argument("--api-key-file", default=None, help="file holding the API key clients must send as "
                    "`authorization: Bearer KEY` (default: $TANDEM_API_KEY; unset: no auth)")
    ap.add_argument("--queue-timeout", type=float, default=60.0,
                    help="seconds a request may wait for decode capacity before RESOURCE_EXHAUSTED")
    ap.add_argument("--max-queued-requests", type=int, default=256,
                    help="requests that may wait for decode capacity; beyond: RESOURCE_EXHAUSTED / HTTP 429 at once")
    ap.add_argument("--max-concurrent-rpcs", type=int, default=1024,
                    help="calls the gRPC server takes at once (beyond: RESOURCE_EXHAUSTED)")
    ap.add_argument("--max-request-bytes", type=int, default=8 << 20,
                    help="largest request message (gRPC) or body (HTTP) accepted")
    ap.add_argument("--decode-failover", action="store_true",
                    help="when a decode worker dies mid-stream, continue its requests on another one (re-prefilling "
                    "prompt + generated tokens; exact for greedy sampling without penalties)")
    add_routing_args(ap)
    add_tls_args(ap)
    add_cors_args(ap)
    add_parser_args(ap)


def main(args) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s router %(levelname)s %(message)s")
    require_free_ports(args.host, {"gRPC": args.port, "HTTP": args.http_port, "metrics": args.metrics_port})
    cfg = model_config(args.model)
    try:
        parsers = Parsers.from_args(args, cfg.model_type)
    except ValueError as e:
        log.error("%s", e)
        return 2
    try:
        routing = RoutingConfig.from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    metrics, metrics_address = start_metrics(args, "router")
    tls = Tls.from_args(args)
    token = internal_token(args, "router")
    colocated = not _list(args.prefill_workers) and not args.prefill_dns
    if colocated:
        log.info("no prefill workers: colocated mode, decode workers prefill their requests")
    prefill = None if colocated else WorkerPool("prefill", _list(args.prefill_workers), args.prefill_dns,
                                                args.poll_seconds, metrics, tls=tls, internal_token=token,
                                                routing=routing).start()
    decode = WorkerPool("decode", _list(args.decode_workers), args.decode_dns, args.poll_seconds, metrics,
                        tls=tls, internal_token=token, routing=routing).start()
    tokenizer = load_tokenizer_for(args.model)
    model_name = served_model_name(args)
    router = Router(cfg, model_name, args.max_model_len,
                    args.num_speculative_tokens, prefill, decode, tokenizer, queue_timeout=args.queue_timeout,
                    metrics=metrics, max_queued_requests=args.max_queued_requests,
                    decode_failover=args.decode_failover)
    api_key = load_api_key(args.api_key_file)
    server = Server(max_workers=args.max_concurrent_rpcs, interceptors=[ApiKeyInterceptor(api_key)] if api_key else [],
                    tls=tls, max_receive=args.max_request_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs)
    server.add(router_pb2_grpc.add_TandemServicer_to_server, router,
               router_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name)
    port = server.start(args.host, args.port)
    http = None
    if args.http_port is not None:
        from router.http import start_http_server

        http = start_http_server(f"127.0.0.1:{port}", args.host, args.http_port, model_name, tokenizer,
                                 args.max_model_len, api_key=api_key, tls=tls,
                                 max_body_bytes=args.max_request_bytes, metrics_registry=metrics.registry,
                                 cors=Cors.from_args(args), parsers=parsers)
    announce("router", grpc=f"{advertise_host(args)}:{port}", metrics=metrics_address,
             http=f"{advertise_host(args)}:{http.port}" if http else None)
    serve_until_signalled(server, router, args.drain_timeout)
    if http is not None:
        http.stop()
    return 0
