"""CORS for the HTTP endpoint, with vLLM's flags: `--allowed-origins` (a JSON list or a comma list; default none:
no CORS headers at all), `--allowed-methods`, `--allowed-headers` (default `*`), `--allow-credentials`.

With origins set, a preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered before authentication
(browsers send no credentials on it), and every response to an allowed origin carries
`Access-Control-Allow-Origin`, error responses and event streams included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

from router.http_errors import ApiError

ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
PREFLIGHT_MAX_AGE = "600"  # seconds a browser may cache a preflight answer


def parse_list(s: str) -> list[str]:
    """`["a", "b"]` (vLLM's JSON form) or `a,b`."""
    s = s.strip()
    if s.startswith("["):
        v = json.loads(s)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"not a JSON list of strings: {s}")
        return v
    return [x.strip() for x in s.split(",") if x.strip()]


def add_cors_args(ap) -> None:
    ap.add_argument("--allowed-origins", type=parse_list, default=[],
                    help="CORS origins allowed to call the HTTP API, a JSON list or comma list ('*': any; default: "
                    "none, no CORS headers)")
    ap.add_argument("--allowed-methods", type=parse_list, default=["*"], help="CORS methods (default: all)")
    ap.add_argument("--allowed-headers", type=parse_list, default=["*"], help="CORS request headers (default: all)")
    ap.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")


def cors_argv(args) -> list[str]:
    """The CORS flags of `args` as argv, for a launcher passing them on to the router."""
    if not args.allowed_origins:
        return []
    return ["--allowed-origins", json.dumps(args.allowed_origins), "--allowed-methods",
            json.dumps(args.allowed_methods), "--allowed-headers", json.dumps(args.allowed_headers),
            *(["--allow-credentials"] if args.allow_credentials else [])]


@dataclass(frozen=True)
class Cors:
    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    @classmethod
    def from_args(cls, args) -> Cors | None:
        if not args.allowed_origins:
            return None
        return cls(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                   args.allow_credentials)

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self.preflight)
        app.on_response_prepare.append(self.add_headers)

    def _allowed(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin in self.origins)

    def _allow_origin(self, origin: str) -> dict[str, str]:
        # `*` cannot be combined with credentials: the origin itself is sent then
        if "*" in self.origins and not self.credentials:
            return {"Access-Control-Allow-Origin": "*"}
        out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    @web.middleware
    async def preflight(self, request: web.Request, handler):
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or method is None or "Origin" not in request.headers:
            return await handler(request)
        origin = request.headers["Origin"]
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        refused = ("origin" if not self._allowed(origin) else
                   "method" if "*" not in self.methods and method.upper() not in {m.upper() for m in self.methods}
                   else "headers" if "*" not in self.headers and
                   not {h.lower() for h in asked} <= {h.lower() for h in self.headers} else None)
        if refused is not None:
            raise ApiError(400, f"CORS preflight refused: {refused} not allowed", "invalid_request_error")
        headers = self._allow_origin(origin)
        headers["Access-Control-Allow-Methods"] = ALL_METHODS if "*" in self.methods else ", ".join(self.methods)
        if asked:
            headers["Access-Control-Allow-Headers"] = ", ".join(asked) if "*" in self.headers else \
                ", ".join(self.headers)
        headers["Access-Control-Max-Age"] = PREFLIGHT_MAX_AGE
        return web.Response(status=200, headers=headers)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if self._allowed(origin) and "Access-Control-Allow-Origin" not in response.headers:
            for k, v in self._allow_origin(origin).items():
                response.headers[k] = v
