"""`tandem serve` for multi-process tests (127.0.0.1, free ports) and the check that nothing stays allocated."""

import grpc
import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.launch import ServeProcess as Cluster

__all__ = ["Cluster", "assert_idle", "cancel_at_three_stages", "long_request"]


def long_request():
    return [5, 6, 7, 8], SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)


def cancel_at_three_stages(cluster: Cluster) -> None:
    """Client cancels before the first token (reserving / prefilling), right after it, and while decoding: each
    ends CANCELLED and nothing stays allocated."""
    for reads in (0, 1, 3):
        call = cluster.client.generate(*long_request(), timeout=120)
        it = iter(call)
        for _ in range(reads):
            next(it)
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(it)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    assert_idle(cluster)


def assert_idle(cluster: Cluster) -> None:
    info = cluster.wait_idle()
    limit = cluster.client.model_info().max_model_len  # the router's --max-model-len, as `tandem serve` passed it
    for w in info.workers:
        ld = w.load
        assert w.healthy, w
        assert ld.max_model_len == limit, (w.address, ld)
        assert ld.free_kv_blocks == ld.total_kv_blocks > 0, (w.address, ld)
        assert ld.free_state_slots == ld.total_state_slots > 0, (w.address, ld)
        assert ld.active_leases == ld.running_requests == ld.waiting_requests == 0, (w.address, ld)
