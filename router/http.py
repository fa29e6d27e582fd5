"""OpenAI-compatible HTTP in the router process: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
vLLM's `/tokenize` and `/detokenize`, and the router's `/metrics`.

    srv = start_http_server("127.0.0.1:50051", "0.0.0.0", 8000, "qwen3.5-35b-a3b", tokenizer, max_model_len=4096)
    ... srv.port ... srv.stop()

Each OpenAI request becomes one `tandem.v1.Tandem/Generate` stream per choice, sent to the router's own gRPC
endpoint over loopback: validation, tokenization, stop strings and scheduling stay on one code path, and the HTTP
side only translates. It runs aiohttp on its own thread and event loop, so it never blocks the gRPC server's
threads. A client that disconnects cancels its gRPC calls (the router then aborts the request on the workers).

The event loop only moves bytes: parsing and checking bodies (router/http_fields.py), chat templating,
tokenization and the detokenization of long token lists run on a bounded thread pool (router/cpu_pool.py), so
/health and other clients' streams stay quick while a multi-megabyte request is processed. Every error is OpenAI's
error JSON (router/http_errors.py). A chat answer is split into `reasoning_content`, `content` and `tool_calls`
(router/chat_choice.py) by the parsers the server was started with (router/chat_parsers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from types import SimpleNamespace

import grpc
import prometheus_client
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from router import http_fields as fields
from router.auth import bearer_ok
from router.chat_choice import ChatChoice, OutputFormat
from router.chat_parsers import Parsers
from router.chat_tools import Tools, request_tools, template_message
from router.structured_fields import constraint
from router.tool_grammar import tool_call_grammar
from router.cors import Cors
from router.cpu_pool import CpuPool
from router.http_errors import ApiError, bad, error_middleware, from_grpc, internal_error
from router.reasoning import prompt_opens_think
from tandem.rpc import common_pb2, router_pb2, router_pb2_grpc
from tandem.rpc.convert import finish_reason_name
from tandem.rpc.server import Tls, channel_options

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 3600.0  # seconds: the deadline of one choice's gRPC call (OpenAI has no per-request deadline)
INLINE_TOKENS = 64  # a response message with more tokens to turn into strings is converted on the CPU pool
INFO_SECONDS = 5.0  # how long the router's model info (speculative tokens, max_model_len) is reused


# ---- the app ------------------------------------------------------------------------------------------------------
class _Api:
    def __init__(self, grpc_address: str, model_name: str, tokenizer, max_model_len: int | None,
                 request_timeout: float = REQUEST_TIMEOUT, api_key: str | None = None, tls: Tls | None = None,
                 max_body_bytes: int = 64 * 1024 * 1024, metrics_registry: CollectorRegistry | None = None,
                 cors: Cors | None = None, pool: CpuPool | None = None, parsers: Parsers | None = None):
        self.parsers = parsers or Parsers()
        self.tls, self.max_body_bytes, self.metrics_registry, self.cors = tls, max_body_bytes, metrics_registry, cors
        self.grpc_address, self.model_name, self.tok = grpc_address, model_name, tokenizer
        # None: the router's (which may learn it from the workers), read with the speculative tokens (`_info`)
        self._fixed_len, self.max_model_len = max_model_len, max_model_len or 0
        self.api_key = api_key
        # the router's gRPC side checks the same key: forward it on the loopback calls
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.channel = self.stub = self.health = None
        self.pool = pool or CpuPool()
        self._k: int | None = None
        self._info_at = -INFO_SECONDS

    async def on_startup(self, app) -> None:
        self.channel = (grpc.aio.secure_channel(self.grpc_address, self.tls.channel_credentials(),
                                                options=channel_options()) if self.tls
                        else grpc.aio.insecure_channel(self.grpc_address, options=channel_options()))
        self.stub = router_pb2_grpc.TandemStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def on_cleanup(self, app) -> None:
        await self.channel.close()
        self.pool.shutdown()

    @web.middleware
    async def authenticate(self, request, handler):
        """/v1/* and the tokenizer routes need `Authorization: Bearer KEY` when the router has a key; /health and
        /metrics stay open for probes and scrapers."""
        if self.api_key and request.path.startswith(("/v1/", "/tokenize", "/detokenize")) and \
                not bearer_ok(request.headers.get("Authorization"), self.api_key):
            raise ApiError(401, "missing or invalid API key", "invalid_request_error", code="invalid_api_key")
        return await handler(request)

    def app(self) -> web.Application:
        """Error JSON outermost (it sees every other layer's failures), then CORS (preflights need no key), then
        the API key."""
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[error_middleware])
        if self.cors is not None:
            self.cors.install(app)
        app.middlewares.append(self.authenticate)
        app.add_routes(self.routes())
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        return app

    def routes(self) -> list:
        routes = [web.get("/health", self.health_check), web.get("/v1/models", self.models),
                  web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                  web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)]
        if self.metrics_registry is not None:
            routes.append(web.get("/metrics", self.metrics))
        return routes

    # -- simple endpoints
    async def health_check(self, request) -> web.Response:
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(
                service=router_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name), timeout=5.0)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return web.Response(status=200)
        except grpc.aio.AioRpcError:
            pass
        raise ApiError(503, "the router is not ready", "service_unavailable_error")

    async def models(self, request) -> web.Response:
        await self._info()
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tandem",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request) -> web.Response:
        """The router's own Prometheus registry (as on --metrics-port), as vLLM serves /metrics on its API port."""
        return web.Response(body=prometheus_client.generate_latest(self.metrics_registry),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    # -- vLLM's tokenizer routes (`vllm bench serve` aligns its prompts to the server's tokenizer through them)
    def _tokenizer(self):
        if self.tok is None:
            raise bad("this model has no tokenizer: prompts must be token ids")
        return self.tok

    async def tokenize(self, request) -> web.Response:
        await self._info()
        return web.json_response(await self.pool.run(self._tokenize, await self._body(request)))

    def _tokenize(self, body: dict) -> dict:
        tok = self._tokenizer()
        if "messages" in body:
            ids, _ = self._chat_prompt(body, request_tools(body))
        else:
            prompt = fields.field(body, "prompt", (str,), None)
            if prompt is None:
                raise bad("'prompt' (a string) or 'messages' is required", "prompt")
            ids = tok.encode(prompt, add_special_tokens=fields.field(body, "add_special_tokens", (bool,), True))
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if fields.field(body, "return_token_strs", (bool,), False):
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, request) -> web.Response:
        return web.json_response(await self.pool.run(self._detokenize, await self._body(request)))

    def _detokenize(self, body: dict) -> dict:
        tok = self._tokenizer()
        tokens = body.get("tokens")
        vocab = len(tok)
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise bad(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": tok.decode(tokens)}

    async def _info(self) -> None:
        """The router's speculative tokens and (without a fixed one) max_model_len, re-read every INFO_SECONDS."""
        if self._k is not None and (self._fixed_len or time.monotonic() - self._info_at < INFO_SECONDS):
            return
        info = await self.stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=10.0, metadata=self.metadata)
        self._k, self._info_at = info.num_speculative_tokens, time.monotonic()
        if not self._fixed_len:
            self.max_model_len = info.max_model_len

    async def _speculative_tokens(self) -> int:
        await self._info()
        return self._k

    # -- shared parsing
    async def _body(self, request) -> dict:
        """The request's JSON object, parsed and checked on the CPU pool (a body may be megabytes)."""
        raw = await request.read()  # past client_max_size: aiohttp's 413, as OpenAI JSON by the error middleware
        body = await self.pool.run(fields.parse_body, raw)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "not_found_error", "model",
                           "model_not_found")
        return body

    def _token_str(self, tid: int) -> str:
        if self.tok is None:
            return f"token_id:{tid}"  # vLLM's spelling when tokens are returned as ids
        return self.tok.decode([tid], skip_special_tokens=False)

    def _top(self, lp: common_pb2.TokenLogprobs) -> list[tuple[int, float]]:
        return sorted(zip(lp.token_ids, lp.logprobs), key=lambda x: -x[1])

    def _completion_logprobs(self, token_ids, entries, offset: int) -> tuple[dict, int]:
        """OpenAI's completion logprobs of `token_ids`, one TokenLogprobs (or None: no logprob, as for the first
        prompt token) each; text offsets count on from `offset`. -inf is sent as -9999.0, as vLLM does (JSON has
        no infinity)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(token_ids, entries):
            s = self._token_str(tid)
            out["tokens"].append(s)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                v = dict(zip(lp.token_ids, lp.logprobs)).get(tid)
                out["token_logprobs"].append(None if v is None else max(v, -9999.0))
                out["top_logprobs"].append({self._token_str(t): max(v, -9999.0) for t, v in self._top(lp)})
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def _chat_logprobs(self, m, top_n: int) -> dict:
        content = []
        for tid, lp in zip(m.token_ids, m.logprobs):
            d = dict(zip(lp.token_ids, lp.logprobs))
            s = self._token_str(tid)
            content.append({"token": s, "logprob": d.get(tid), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": (t := self._token_str(i)), "logprob": v,
                                              "bytes": list(t.encode())} for i, v in self._top(lp)[:top_n]]})
        return {"content": content}

    def _requests(self, body: dict, prompts, sampling: common_pb2.SamplingParams, n: int):
        """n requests per prompt (choice index = prompt index * n + j); seeds offset by j, so that the n choices
        of a seeded request differ and stay reproducible."""
        stop, skip = fields.stop(body), fields.field(body, "skip_special_tokens", (bool,), True)
        reqs = []
        for p in prompts:
            for j in range(n):
                r = router_pb2.GenerateRequest(request_id=uuid.uuid4().hex, stop=stop, skip_special_tokens=skip)
                r.sampling.CopyFrom(sampling)
                if sampling.HasField("seed") and j:
                    r.sampling.seed = (sampling.seed + j + 2**63) % 2**64 - 2**63
                if isinstance(p, str):
                    r.text = p
                else:
                    r.token_ids.ids.extend(p)
                reqs.append(r)
        return reqs

    async def _pump(self, i: int, req, queue: asyncio.Queue) -> None:
        # Always a deadline: the router bounds its worker calls by the client's (and fails a call that has none).
        call = self.stub.Generate(req, timeout=self.request_timeout, metadata=self.metadata)
        try:
            async for m in call:
                await queue.put((i, m))
            await queue.put((i, None))
        except grpc.aio.AioRpcError as e:
            await queue.put((i, e))
        finally:
            call.cancel()  # no-op when finished; otherwise the router aborts the request on the workers

    async def _merged(self, reqs):
        """(choice index, GenerateResponse) from all the choices' streams as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, r, queue)) for i, r in enumerate(reqs)]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, grpc.aio.AioRpcError):
                    raise from_grpc(item)
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _chunk(self, chunk_fn, i: int, m):
        """chunk_fn(i, m), on the CPU pool when the message has many tokens to turn into strings (a long prompt's
        logprobs); inline otherwise, so streams do not queue behind other requests' tokenization."""
        if len(m.token_ids) + len(m.prompt_token_ids) > INLINE_TOKENS:
            return await self.pool.run(chunk_fn, i, m)
        return chunk_fn(i, m)

    async def _run(self, request, reqs, n: int, stream: bool, chunk_fn, final_fn, head: dict, include_usage: bool,
                   count_completion: bool = True):
        """Streams SSE chunks (`chunk_fn(i, m) -> dict | None`), or collects and returns `final_fn()`. The SSE
        response starts with the first message, so an error before it (bad input) is still a plain HTTP error.
        `count_completion` False: the generated tokens are not returned (echo with max_tokens 0), usage counts 0."""
        resp = None
        usage = {"prompt": {}, "completion": {}, "cached": {}}

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        try:
            async with contextlib.aclosing(self._merged(reqs)) as msgs:
                async for i, m in msgs:
                    usage["prompt"][i] = m.prompt_tokens
                    usage["cached"][i] = m.cached_tokens
                    usage["completion"][i] = m.completion_tokens if count_completion else 0
                    chunk = await self._chunk(chunk_fn, i, m)
                    if not stream:
                        continue
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                        await resp.prepare(request)
                    for c in chunk or ():
                        await send(c)
        except Exception as e:
            if resp is None:
                raise  # no byte sent yet: the error middleware answers it
            if not isinstance(e, ApiError):
                log.exception("unexpected error while streaming %s", request.path)
                e = internal_error()
            await send(e.body())  # mid-stream: the error as an event, then the end marker
            await resp.write(b"data: [DONE]\n\n")
            return resp
        u = self._usage(usage, n)
        if not stream:
            return web.json_response(final_fn(u))
        if include_usage:
            await send(dict(head, choices=[], usage=u))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _usage(usage: dict, n: int) -> dict:
        prompt = sum(v for i, v in usage["prompt"].items() if i % n == 0)  # each prompt once, not once per choice
        completion = sum(usage["completion"].values())
        cached = sum(v for i, v in usage["cached"].items() if i % n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- /v1/completions
    def _completion_request(self, body: dict) -> SimpleNamespace:
        """Checks a completion body and builds its gRPC requests (on the CPU pool: prompts may be long id lists)."""
        fields.unsupported(body, {"suffix": ("",), "logit_bias": ({},), "use_beam_search": (False,)})
        if body.get("prompt_logprobs") is not None:  # vLLM's extra field; the OpenAI way is supported
            raise bad("'prompt_logprobs' is not supported by this server: 'echo': true with 'logprobs': N "
                      "returns the prompt tokens' logprobs", "prompt_logprobs")
        if "prompt" not in body:
            raise bad("'prompt' is required", "prompt")
        prompts = fields.prompts(body["prompt"])
        echo = fields.field(body, "echo", (bool,), False)
        n = fields.integer(body, "n", 1, fields.MAX_N + 1, 1)
        best_of = fields.field(body, "best_of", (int,), n)
        if best_of != n:
            raise bad("'best_of' other than n is not supported", "best_of")
        logprobs = fields.integer(body, "logprobs", 0, fields.MAX_LOGPROBS + 1)
        # max_tokens 0 only with echo (the prompt alone, as vLLM): one token is generated and dropped
        max_tokens = fields.max_tokens(body, ("max_tokens",), least=0 if echo else 1)
        echo_only = echo and max_tokens == 0
        sampling = fields.sampling(body, 1 if echo_only else max_tokens, logprobs)
        if (so := constraint(body)) is not None:
            sampling.structured_outputs.CopyFrom(so)
        if echo and logprobs is not None:  # echo with logprobs: the prompt tokens' logprobs come first
            sampling.prompt_logprobs = logprobs
        return SimpleNamespace(
            reqs=self._requests(body, prompts, sampling, n), n=n, echo_only=echo_only, logprobs=logprobs,
            echo_texts=[self._prompt_text(p) for p in prompts] if echo else None,
            stream=fields.field(body, "stream", (bool,), False), include_usage=self._include_usage(body))

    @staticmethod
    def _include_usage(body: dict) -> bool:
        return bool((fields.field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))

    async def completions(self, request) -> web.StreamResponse:
        c = await self.pool.run(self._completion_request, await self._body(request))
        reqs, n, logprobs = c.reqs, c.n, c.logprobs
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        texts, reasons, lps, offsets = ([""] * len(reqs), [None] * len(reqs), [None] * len(reqs),
                                        [0] * len(reqs))
        echoed = [c.echo_texts is None] * len(reqs)

        def chunk(i, m):
            reason = finish_reason_name(m.finish_reason)
            text, ids, entries = m.text, list(m.token_ids), list(m.logprobs)
            if c.echo_only:  # the generated token is not part of the answer; the prompt ends it by length
                text, ids, entries = "", [], []
                reason = reason if reason in (None, "abort") else "length"
            if not echoed[i]:  # echo: the first chunk of a choice starts with its prompt (and its logprobs)
                echoed[i] = True
                text = c.echo_texts[i // n] + text
                # the prompt ids come with the prompt logprobs (None for the first token), when asked for
                prompt_ids = list(m.prompt_token_ids)
                ids, entries = prompt_ids + ids, [None, *m.prompt_logprobs][:len(prompt_ids)] + entries
            lp = None
            if logprobs is not None:
                lp, offsets[i] = self._completion_logprobs(ids, entries, offsets[i])
                if lps[i] is None:
                    lps[i] = {k: [] for k in lp}
                for k, v in lp.items():
                    lps[i][k].extend(v)
            texts[i] += text
            reasons[i] = reason
            return [dict(head, choices=[{"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                                          "stop_reason": None}])]

        def final(usage):
            return dict(head, usage=usage, choices=[
                {"index": i, "text": texts[i], "logprobs": lps[i], "finish_reason": reasons[i], "stop_reason": None}
                for i in range(len(reqs))])

        return await self._run(request, reqs, n, c.stream, chunk, final, head, c.include_usage,
                               count_completion=not c.echo_only)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """The echoed prompt: as sent, or token ids decoded (special tokens kept, as vLLM echoes them)."""
        if isinstance(prompt, str):
            return prompt
        return self.tok.decode(prompt, skip_special_tokens=False) if self.tok is not None else ""

    # -- /v1/chat/completions
    def _chat_prompt(self, body: dict, tools: Tools) -> tuple[list[int], str]:
        """The rendered chat prompt (with the request's tools and chat_template_kwargs): its ids and its text."""
        if self.tok is None or getattr(self.tok, "chat_template", None) is None:
            raise bad("this model has no chat template (no tokenizer or no chat_template): "
                      "use /v1/completions", "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("'messages' must be a non-empty list", "messages")
        clean = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad("each message needs a 'role' string", "messages")
            content = m.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise bad("only text content parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            elif not isinstance(content, str):
                raise bad("message 'content' must be a string or a list of text parts", "messages")
            clean.append(template_message(dict(m, content=content)))
        kwargs = fields.field(body, "chat_template_kwargs", (dict,), {})
        try:
            text = self.tok.apply_chat_template(
                clean, add_generation_prompt=fields.field(body, "add_generation_prompt", (bool,), True),
                tokenize=False, tools=tools.tools, **kwargs)
        except Exception as e:  # a template that rejects the conversation (jinja raises its own errors)
            raise bad(f"the chat template failed: {e}", "messages") from None
        return self.tok.encode(text, add_special_tokens=False), text

    def _chat_request(self, body: dict) -> SimpleNamespace:
        """Checks a chat body, templates and tokenizes it (on the CPU pool: this is the slow part of a long chat)."""
        fields.unsupported(body, {"logit_bias": ({},), "use_beam_search": (False,)})
        tools = request_tools(body)
        tools.check_servable(self.parsers.auto_tool_choice, self.parsers.tool_call)
        # tool_choice required or named: the output is tool calls, by grammar (as vLLM enforces them)
        forced = tools.choice in ("required", "named")
        so = constraint(body, tool_call_grammar(tools.tools, tools.named, tools.parallel) if forced else None)
        ids, text = self._chat_prompt(body, tools)
        if len(ids) > self.max_model_len:
            raise bad(f"the prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})", "messages")
        # vLLM's chat echo: the answer starts with the last message when that is the assistant's (continuing it)
        last = body["messages"][-1]
        echo = fields.field(body, "echo", (bool,), False) and last["role"] == "assistant"
        content = (last.get("content") or "") if echo else ""
        n = fields.integer(body, "n", 1, fields.MAX_N + 1, 1)
        want_lp = fields.field(body, "logprobs", (bool,), False)
        top_n = fields.integer(body, "top_logprobs", 0, fields.MAX_LOGPROBS + 1, 0)
        if top_n and not want_lp:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        max_tokens = fields.max_tokens(body, ("max_completion_tokens", "max_tokens"))
        sampling = fields.sampling(body, max_tokens, top_n if want_lp else None)
        if so is not None:
            sampling.structured_outputs.CopyFrom(so)
            # a thinking model thinks first: the constraint applies to the answer after its reasoning
            sampling.structured_outputs.after_think = self.parsers.reasoning is not None and prompt_opens_think(text)
        fmt = OutputFormat(reasoning=self.parsers.reasoning is not None, prompt_in_think=prompt_opens_think(text),
                           tools=tools.schemas() if tools.parsed() else None, parallel=tools.parallel)
        return SimpleNamespace(
            prompt_len=len(ids), reqs=self._requests(body, [ids], sampling, n), n=n, want_lp=want_lp, top_n=top_n,
            fmt=fmt, echo_text="\n".join(p["text"] for p in content) if isinstance(content, list) else content,
            stream=fields.field(body, "stream", (bool,), False), include_usage=self._include_usage(body))

    async def chat(self, request) -> web.StreamResponse:
        await self._info()
        c = await self.pool.run(self._chat_request, await self._body(request))
        n, top_n, echo_text = c.n, c.top_n, c.echo_text
        if not c.reqs[0].sampling.HasField("max_tokens"):  # as vLLM: whatever room the context leaves
            max_tokens = self.max_model_len - c.prompt_len - await self._speculative_tokens()
            if max_tokens < 1:
                raise bad(f"the prompt ({c.prompt_len} tokens) leaves no room within max_model_len "
                          f"({self.max_model_len})", "messages")
            for r in c.reqs:
                r.sampling.max_tokens = max_tokens
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        outs, reasons, lps, started = [ChatChoice(c.fmt) for _ in range(n)], [None] * n, [None] * n, [False] * n

        def chunk(i, m):
            out = []
            if not started[i]:  # OpenAI's first delta of a choice carries the role
                started[i] = True
                out.append(dict(head, choices=[{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]))
                if echo_text:
                    out.append(dict(head, choices=[{"index": i, "delta": {"content": echo_text}, "logprobs": None,
                                                    "finish_reason": None}]))
            reason = finish_reason_name(m.finish_reason)
            lp = self._chat_logprobs(m, top_n) if c.want_lp else None
            if lp is not None:
                lps[i] = lps[i] or {"content": []}
                lps[i]["content"] += lp["content"]
            delta = outs[i].feed(m.text)
            if reason is not None:  # the choice's last message: what the parsers held back, and its real reason
                delta = _merged_delta(delta, outs[i].finish())
                reason = outs[i].finish_reason(reason)
            reasons[i] = reason
            if delta or reason or lp:
                out.append(dict(head, choices=[{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}]))
            return out

        def final(usage):
            return dict(head, object="chat.completion", usage=usage, choices=[
                {"index": i, "message": _with_echo(outs[i].message(), echo_text), "logprobs": lps[i],
                 "finish_reason": reasons[i]} for i in range(n)])

        return await self._run(request, c.reqs, n, c.stream, chunk, final, head, c.include_usage)


def _merged_delta(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def _with_echo(message: dict, echo_text: str) -> dict:
    if echo_text:
        message["content"] = echo_text + (message["content"] or "")
    return message


class HttpServer:
    """The aiohttp app on its own thread and event loop; `.port` is the bound port, `.stop()` ends it."""

    def __init__(self, api: _Api, host: str, port: int):
        self.api, self.host, self.port = api, host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._main, name="tandem-http", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    async def _start(self) -> None:
        app = self.api.app()
        # handler_cancellation: a client that goes away cancels its handler, and so its gRPC calls
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        # HTTPS with the router's certificate; clients authenticate with the API key, not a client certificate
        tls = self.api.tls.server_context(require_client_cert=False) if self.api.tls and self.api.tls.cert else None
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=tls)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:  # e.g. the port is taken: reported to the caller of start_http_server
            self._error = e
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)


def start_http_server(grpc_address: str, host: str, port: int, model_name: str, tokenizer,
                      max_model_len: int | None, request_timeout: float = REQUEST_TIMEOUT,
                      api_key: str | None = None, tls: Tls | None = None,
                      max_body_bytes: int = 64 * 1024 * 1024, metrics_registry: CollectorRegistry | None = None,
                      cors: Cors | None = None, pool: CpuPool | None = None,
                      parsers: Parsers | None = None) -> HttpServer:
    """Serves OpenAI's API on host:port (0: any free port) in front of the router at `grpc_address`; with
    `metrics_registry`, also that registry at /metrics."""
    return HttpServer(_Api(grpc_address, model_name, tokenizer, max_model_len, request_timeout, api_key, tls,
                           max_body_bytes, metrics_registry, cors, pool, parsers), host, port)
