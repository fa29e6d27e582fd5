"""One streamed request, timed: over gRPC (`tandem.v1.Tandem/Generate`) or OpenAI completions SSE (any
OpenAI-compatible server, Tandem's router included). Each records when every chunk arrived; a chunk may carry
several tokens (one speculative step), as vLLM's client counts them too. Where the server says how many prompt
tokens came from its prefix cache (gRPC `cached_tokens`, HTTP `usage.prompt_tokens_details.cached_tokens`), the
output keeps it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from tandem.bench.datasets import SampleRequest


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks after the first
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk (1 each where the wire doesn't say)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    output_ids: list[int] | None = None  # the answer's token ids, where the wire carries them (gRPC)
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache; None: not reported
    turn: int = 0  # its index in its conversation (multi-turn)
    error: str = ""


@dataclass
class RequestSettings:
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    timeout: float = 3600.0
    structured_outputs: dict | None = None  # vLLM's request field: every request under this constraint


class _Timer:
    def __init__(self, out: RequestOutput):
        self.out, self.last = out, None
        out.start_time = time.perf_counter()

    def chunk(self, n_tokens: int) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.out.ttft = now - self.out.start_time
        else:
            self.out.itl.append(now - self.last)
        self.last = now
        self.out.chunk_tokens.append(n_tokens)

    def done(self) -> None:
        self.out.latency = time.perf_counter() - self.out.start_time


class GrpcBackend:
    name = "grpc"

    def __init__(self, address: str):
        self.address = address
        self.channel = self.stub = None
        self.cached_field = None

    async def open(self) -> None:
        import grpc

        from tandem.rpc import router_pb2, router_pb2_grpc
        from tandem.rpc.server import channel_options

        # where the proto has the field, the responses say how many prompt tokens the prefix cache served
        # (`cached_tokens` as in OpenAI's usage, or the workers' `num_cached_tokens`)
        fields = router_pb2.GenerateResponse.DESCRIPTOR.fields_by_name
        self.cached_field = next((f for f in ("cached_tokens", "num_cached_tokens") if f in fields), None)
        self.channel = grpc.aio.insecure_channel(self.address, options=channel_options())
        self.stub = router_pb2_grpc.TandemStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def model_info(self) -> dict:
        from tandem.rpc import router_pb2

        info = await self.stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=30)
        return {"model": info.model_name, "vocab_size": info.vocab_size, "max_model_len": info.max_model_len}

    async def request(self, req: SampleRequest, s: RequestSettings) -> RequestOutput:
        import grpc

        from tandem.rpc import router_pb2

        msg = router_pb2.GenerateRequest(skip_special_tokens=True)
        msg.sampling.max_tokens, msg.sampling.temperature, msg.sampling.ignore_eos = \
            req.output_len, s.temperature, s.ignore_eos
        if s.top_p is not None:
            msg.sampling.top_p = s.top_p
        if s.top_k is not None:
            msg.sampling.top_k = max(s.top_k, 0)
        if s.structured_outputs is not None:
            from tandem.rpc.convert import structured_to_proto
            from tandem.structured import StructuredOutputs

            msg.sampling.structured_outputs.CopyFrom(structured_to_proto(StructuredOutputs(**s.structured_outputs)))
        if isinstance(req.prompt, str):
            msg.text = req.prompt
        else:
            msg.token_ids.ids.extend(req.prompt)
        out = RequestOutput(prompt_len=req.prompt_len, output_ids=[])
        timer, text = _Timer(out), []
        call = self.stub.Generate(msg, timeout=s.timeout)
        try:
            async for m in call:
                if m.token_ids:
                    timer.chunk(len(m.token_ids))
                    out.output_ids.extend(m.token_ids)
                text.append(m.text)
                out.output_tokens, out.prompt_len = m.completion_tokens, m.prompt_tokens or out.prompt_len
                if self.cached_field:
                    out.cached_tokens = max(out.cached_tokens or 0, getattr(m, self.cached_field))
            out.success = True
        except grpc.aio.AioRpcError as e:
            out.error = f"{e.code().name}: {e.details()}"
        finally:
            call.cancel()
        timer.done()
        out.generated_text = "".join(text)
        return out


class OpenAICompletionsBackend:
    name = "openai"

    def __init__(self, base_url: str, endpoint: str = "/v1/completions", model: str | None = None):
        self.base_url, self.endpoint, self.model = base_url.rstrip("/"), endpoint, model
        self.session = None

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=6 * 3600),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        await self.session.close()

    async def model_info(self) -> dict:
        async with self.session.get(self.base_url + "/v1/models") as r:
            r.raise_for_status()
            card = (await r.json())["data"][0]
        self.model = self.model or card["id"]
        return {"model": self.model, "vocab_size": None, "max_model_len": card.get("max_model_len")}

    async def request(self, req: SampleRequest, s: RequestSettings) -> RequestOutput:
        import aiohttp

        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.output_len,
                "temperature": s.temperature, "stream": True, "stream_options": {"include_usage": True}}
        if s.ignore_eos:
            body["ignore_eos"] = True
        if s.top_p is not None:
            body["top_p"] = s.top_p
        if s.top_k is not None:
            body["top_k"] = s.top_k
        if s.structured_outputs is not None:
            body["structured_outputs"] = s.structured_outputs
        out = RequestOutput(prompt_len=req.prompt_len)
        timer, text = _Timer(out), []
        try:
            async with self.session.post(self.base_url + self.endpoint, json=body) as r:
                if r.status != 200:
                    out.error = f"HTTP {r.status}: {(await r.text())[:500]}"
                    return out
                async for line in r.content:  # SSE: "data: {...}" lines, a blank line between events
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        out.error = event["error"].get("message", str(event["error"]))
                        return out
                    if event.get("choices"):
                        timer.chunk(1)
                        text.append(event["choices"][0].get("text") or "")
                    if usage := event.get("usage"):
                        out.output_tokens = usage["completion_tokens"]
                        out.prompt_len = usage["prompt_tokens"] or out.prompt_len
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            out.cached_tokens = int(details["cached_tokens"])
            out.success = True
        except (aiohttp.ClientError, json.JSONDecodeError, TimeoutError) as e:
            out.error = f"{type(e).__name__}: {e}"
        finally:
            timer.done()
            out.generated_text = "".join(text)
        return out
