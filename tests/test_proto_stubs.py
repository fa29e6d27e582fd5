"""The committed gRPC stubs are what the .proto files generate now (run `make proto` when this fails)."""

import os

from tandem.rpc import regenerate


def test_committed_stubs_are_fresh():
    fresh = regenerate.generate()
    assert fresh, "no stubs generated"
    for name, text in fresh.items():
        path = os.path.join(regenerate.OUT_DIR, name)
        assert os.path.exists(path), f"{name} is not committed: run `make proto`"
        with open(path) as f:
            assert f.read() == text, f"{name} is stale: run `make proto`"


def test_stubs_import_and_round_trip():
    from tandem.rpc import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 2]), stop=["\n"])
    assert router_pb2.GenerateRequest.FromString(req.SerializeToString()) == req
    lease = worker_pb2.Lease(lease_id="x", block_ids=[3, 4], transfer_token=b"\x00\x01")
    assert worker_pb2.Lease.FromString(lease.SerializeToString()).block_ids == [3, 4]
    assert hasattr(router_pb2_grpc, "TandemServicer") and hasattr(worker_pb2_grpc, "DecodeWorkerStub")
