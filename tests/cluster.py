"""`tandem serve` for multi-process tests (127.0.0.1, free ports) and the check that nothing stays allocated."""

from tandem.launch import ServeProcess as Cluster

__all__ = ["Cluster", "assert_idle"]


def assert_idle(cluster: Cluster) -> None:
    info = cluster.wait_idle()
    for w in info.workers:
        ld = w.load
        assert w.healthy, w
        assert ld.free_kv_blocks == ld.total_kv_blocks > 0, (w.address, ld)
        assert ld.free_state_slots == ld.total_state_slots > 0, (w.address, ld)
        assert ld.active_leases == ld.running_requests == ld.waiting_requests == 0, (w.address, ld)
