"""A small gRPC client for the router (used by `tandem request`, the tests and the benchmark)."""

from __future__ import annotations

import time

import grpc

from tandem.engine.sampling_params import SamplingParams
from tandem.rpc import router_pb2, router_pb2_grpc
from tandem.rpc.convert import sampling_to_proto
from tandem.rpc.server import Tls, make_channel


class TandemClient:
    def __init__(self, address: str, api_key: str | None = None, tls: Tls | None = None):
        self.address = address
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.channel = make_channel(address, tls)
        self.stub = router_pb2_grpc.TandemStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def wait_ready(self, timeout: float) -> None:
        """Until the router answers GetModelInfo and every worker it knows is healthy, or `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self.stub.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=5.0, metadata=self.metadata)
                if info.workers and all(w.healthy for w in info.workers):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.address} was not ready within {timeout:.0f} s")
            time.sleep(0.2)

    @staticmethod
    def request(prompt, params: SamplingParams | None = None, request_id: str = "") -> router_pb2.GenerateRequest:
        """prompt: a string or a list of token ids."""
        req = router_pb2.GenerateRequest(request_id=request_id, sampling=sampling_to_proto(params or SamplingParams()))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req

    def generate(self, prompt, params: SamplingParams | None = None, request_id: str = "",
                 timeout: float | None = None):
        """Streams GenerateResponse messages."""
        return self.stub.Generate(self.request(prompt, params, request_id), timeout=timeout, metadata=self.metadata)

    def generate_unary(self, prompt, params: SamplingParams | None = None, request_id: str = "",
                       timeout: float | None = None) -> router_pb2.GenerateResponse:
        return self.stub.GenerateUnary(self.request(prompt, params, request_id), timeout=timeout,
                                       metadata=self.metadata)

    def model_info(self) -> router_pb2.ModelInfo:
        return self.stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=10.0, metadata=self.metadata)

    def server_info(self) -> router_pb2.ServerInfo:
        return self.stub.GetServerInfo(router_pb2.GetServerInfoRequest(), timeout=10.0, metadata=self.metadata)
