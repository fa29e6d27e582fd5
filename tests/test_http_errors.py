"""The HTTP endpoint's error mapping and CPU pool, without a server: every gRPC status has its HTTP status (5xx only
where the server is at fault or cannot serve now), and a saturated pool refuses with 429 instead of queueing
without bound."""

import asyncio
import threading

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from router.cors import parse_list
from router.cpu_pool import CpuPool
from router.http_errors import ApiError, from_grpc

# gRPC's code -> HTTP status, written out from the gRPC and HTTP specs (and nginx's 499) for this test
EXPECTED = {
    "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504, "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429, "FAILED_PRECONDITION": 503,
    "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501, "INTERNAL": 500, "UNAVAILABLE": 503,
    "DATA_LOSS": 500, "UNAUTHENTICATED": 401,
}


def rpc_error(code: grpc.StatusCode, trailing=()) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(*trailing), details=f"details of {code.name}")


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c != grpc.StatusCode.OK], ids=lambda c: c.name)
def test_every_grpc_status_has_its_http_status(code):
    err = from_grpc(rpc_error(code))
    assert err.status == EXPECTED[code.name]
    body = err.body()["error"]
    assert body["message"] == f"details of {code.name}" and body["code"] == code.name.lower() and body["type"]
    # a retry hint exactly where retrying later helps
    assert (err.retry_after is not None) == (err.status in (429, 503))


def test_retry_after_comes_from_the_routers_hint():
    err = from_grpc(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, [("retry-after-ms", "2500")]))
    assert err.response().headers["Retry-After"] == "3"  # whole seconds, rounded up


def test_saturated_pool_refuses_with_429():
    async def main():
        pool = CpuPool(threads=1, max_pending=2)
        release = threading.Event()
        try:
            busy = [asyncio.ensure_future(pool.run(release.wait, 30)) for _ in range(2)]
            await asyncio.sleep(0.05)
            with pytest.raises(ApiError) as e:
                await pool.run(sum, [1, 2])
            assert e.value.status == 429 and e.value.response().headers["Retry-After"] == "1"
            busy[1].cancel()  # a client gone while its job waited: the slot frees when the job is dropped
            await asyncio.sleep(0.05)
            assert pool.pending == 1
            release.set()
            assert await busy[0] is True and await pool.run(sum, [1, 2]) == 3
            assert pool.pending == 0
        finally:
            release.set()
            pool.shutdown()

    asyncio.run(main())


def test_cors_lists_take_json_or_commas():
    assert parse_list('["http://a.example", "http://b.example"]') == ["http://a.example", "http://b.example"]
    assert parse_list("http://a.example, http://b.example") == ["http://a.example", "http://b.example"]
    with pytest.raises(ValueError):
        parse_list('[1, 2]')
