"""P -> D hand-off: packing, checksum, manifest, and end-to-end transfers to a server in another process."""

import json
import multiprocessing as mp
import queue
import socket
import struct
import threading
import time

import pytest
import torch

from tandem.transfer import (
    BACKENDS,
    Manifest,
    TensorSpec,
    TransferClient,
    TransferError,
    TransferRejected,
    TransferServer,
    checksum,
    default_backend,
    model_fingerprint,
    pack,
    unpack,
)
from tandem.transfer import manifest as manifest_mod
from tandem.transfer.contract import HandOff

G = torch.Generator().manual_seed(0)


def _raw(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """Oracle: a tensor's dtype, shape and bytes in row-major order, straight from torch."""
    return str(t.dtype), list(t.shape), t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def _state(seed: int, scale: int = 1, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """A mixed-dtype cache state; non-contiguous members included on purpose."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 3 * scale, 4, 8, generator=g)
    state = [
        ("layer0.kv", kv),
        ("layer1.kv", torch.randn(4, 8, 3 * scale, generator=g).to(torch.bfloat16).transpose(0, 2)),
        ("gdn.conv", torch.randn(5, 7, generator=g)[:, ::2]),
        ("positions", torch.arange(seed, seed + 11 * scale, dtype=torch.int64)),
        ("t_n", torch.tensor(seed + 3, dtype=torch.int64)),
        ("empty", torch.empty(0, 4)),
        ("mask", torch.rand(13, generator=g) > 0.5),
    ]
    return [(n, t.to(device)) for n, t in state]


def _manifest(rid: str, flat: torch.Tensor, specs, with_checksum: bool = True, **meta) -> Manifest:
    return Manifest(
        request_id=rid,
        lease_id=f"lease-{rid}",
        transfer_token=f"token-{rid}",
        fingerprint="fp",
        specs=specs,
        total_bytes=flat.numel(),
        checksum=checksum(flat) if with_checksum else None,
        meta=meta,
    )


# ---------------------------------------------------------------- pack / unpack / checksum / manifest


def test_pack_unpack_roundtrip_mixed_dtypes():
    state = _state(1)
    flat, specs = pack(state)
    assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.is_contiguous()
    assert [s.name for s in specs] == [n for n, _ in state]
    for s in specs:
        assert s.offset % 64 == 0
    for a, b in zip(specs, specs[1:]):
        assert a.offset + a.nbytes <= b.offset
    assert flat.numel() == specs[-1].offset + specs[-1].nbytes
    out = unpack(flat, specs)
    for name, t in state:
        assert _raw(out[name]) == _raw(t), name
    # views, not copies: writing through one is visible in the buffer
    out["positions"][0] = -1
    assert unpack(flat, specs)["positions"][0] == -1


def test_pack_is_deterministic_and_unpack_validates():
    a, specs = pack(_state(2))
    b, _ = pack(_state(2))
    assert torch.equal(a, b)  # padding is zeroed, so equal state gives equal bytes
    bad = [TensorSpec(s.name, s.dtype, s.shape, s.offset, s.nbytes) for s in specs]
    bad[0].nbytes += 4
    with pytest.raises(TransferError):
        unpack(a, bad)
    with pytest.raises(TransferError):
        unpack(a[:-1], specs)
    with pytest.raises(TransferError):
        pack([("x", torch.zeros(1)), ("x", torch.zeros(1))])


def _reference_checksum(data: bytes) -> int:
    # Pure-Python statement of the documented definition: sum of (byte + 1) * (pos + 1) * MUL mod 2**64.
    mul = 0x9E3779B97F4A7C15
    return sum((b + 1) * (i + 1) * mul for i, b in enumerate(data)) % (1 << 64)


def test_checksum_matches_definition_across_chunks(monkeypatch):
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=G)
    want = _reference_checksum(data.numpy().tobytes())
    assert checksum(data) == want
    monkeypatch.setattr(manifest_mod, "_CHECKSUM_CHUNK", 7)  # chunked accumulation gives the same value
    assert checksum(data) == want


def test_checksum_detects_flips_and_swaps():
    data = torch.randint(0, 256, (256,), dtype=torch.uint8, generator=G)
    base = checksum(data)
    assert checksum(data.clone()) == base
    for i in range(data.numel()):
        for bit in (0, 3, 7):
            d = data.clone()
            d[i] ^= 1 << bit
            assert checksum(d) != base, (i, bit)
    for i, j in [(0, 1), (3, 200), (254, 255)]:
        d = data.clone()
        d[j] = (int(data[i]) + 1) % 256  # make sure the two bytes differ
        e = d.clone()
        e[i], e[j] = d[j].item(), d[i].item()
        assert checksum(d) != checksum(e)
    assert checksum(torch.zeros(10, dtype=torch.uint8)) != checksum(torch.zeros(11, dtype=torch.uint8))


def test_manifest_json_roundtrip():
    flat, specs = pack(_state(3))
    m = _manifest("r1", flat, specs, boundary=17, layers=[0, 3])
    data = m.to_json()
    assert isinstance(data, bytes)
    json.loads(data)  # plain JSON
    back = Manifest.from_json(data)
    assert back == m
    assert Manifest.from_json(_manifest("r2", flat, specs, with_checksum=False).to_json()).checksum is None


def _good_dict() -> dict:
    flat, specs = pack(_state(4))
    return _manifest("r", flat, specs).to_dict()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: b"{not json",
        lambda d: b"\xff\xfe",
        lambda d: b"[1, 2]",
        lambda d: {k: v for k, v in d.items() if k != "lease_id"},
        lambda d: {**d, "request_id": 5},
        lambda d: {**d, "total_bytes": -1},
        lambda d: {**d, "checksum": "abc"},
        lambda d: {**d, "meta": []},
        lambda d: {**d, "specs": "x"},
        lambda d: {**d, "specs": [{**d["specs"][0], "dtype": "float99"}]},
        lambda d: {**d, "specs": [{**d["specs"][0], "nbytes": 3}]},
        lambda d: {**d, "specs": [{**d["specs"][0], "offset": 1}]},
        lambda d: {**d, "specs": [{**d["specs"][0], "shape": [1, -2]}]},
        lambda d: {**d, "specs": [d["specs"][0], d["specs"][0]]},
        lambda d: {**d, "total_bytes": 8},
    ],
)
def test_manifest_malformed_raises_transfer_error(mutate):
    out = mutate(_good_dict())
    data = out if isinstance(out, bytes) else json.dumps(out).encode()
    with pytest.raises(TransferError, match="manifest"):
        Manifest.from_json(data)


def _handoff(seed: int) -> HandOff:
    g = torch.Generator().manual_seed(seed)
    return HandOff(first_token=7, drafts=[3, 0], tensors=dict(_state(seed)), first_logprobs={7: -0.25, 9: -1.5},
                   rng_state=torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g))


def test_handoff_through_the_wire_form_and_json():
    """Every field comes back as sent, through the manifest's JSON, the tensors bit for bit; an unseeded, greedy
    request's hand-off (no logprobs, no generator) too."""
    for sent in (_handoff(5), HandOff(first_token=0, drafts=[], tensors=dict(_state(6)))):
        manifest, flat = sent.to_wire("req", "lease", b"\x01\x02", "fp")
        assert (manifest.lease_id, manifest.transfer_token, manifest.checksum) == ("lease", "0102", checksum(flat))
        got = HandOff.from_wire(Manifest.from_json(manifest.to_json()), flat.clone())
        assert (got.first_token, got.drafts, got.first_logprobs) == (sent.first_token, sent.drafts,
                                                                     sent.first_logprobs)
        assert (got.rng_state is None) == (sent.rng_state is None)
        if sent.rng_state is not None:
            assert torch.equal(got.rng_state, sent.rng_state)
        assert list(got.tensors) == list(sent.tensors)
        assert all(_raw(got.tensors[k]) == _raw(v) for k, v in sent.tensors.items())


@pytest.mark.parametrize("meta", [
    {"drafts": []},
    {"first_token": -1, "drafts": []},
    {"first_token": True, "drafts": []},
    {"first_token": 1, "drafts": ["a"]},
    {"first_token": 1, "drafts": [], "first_logprobs": {"x": -1.0}},
    {"first_token": 1, "drafts": [], "first_logprobs": [1]},
    {"first_token": 1, "drafts": [], "rng_state": "not base64!"},
])
def test_handoff_with_malformed_meta_is_refused(meta):
    manifest, flat = _handoff(7).to_wire("req", "lease", b"\x01", "fp")
    manifest.meta = meta
    with pytest.raises(TransferError, match="manifest"):
        HandOff.from_wire(manifest, flat)


def test_model_fingerprint_and_default_backend():
    cfg = {"hidden_size": 64, "layer_types": ["linear_attention", "full_attention"]}
    fp = model_fingerprint(cfg, "bfloat16", 16, "qwen3.5-tiny")
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fp == model_fingerprint(dict(reversed(list(cfg.items()))), "bfloat16", 16, "qwen3.5-tiny")
    assert fp != model_fingerprint(cfg, "float32", 16, "qwen3.5-tiny")
    assert fp != model_fingerprint(cfg, "bfloat16", 32, "qwen3.5-tiny")
    assert BACKENDS == ("tcp", "torch_distributed", "cuda_ipc")
    assert default_backend("cpu", True) == "tcp"
    assert default_backend(torch.device("cpu"), False) == "tcp"
    assert default_backend("cuda:0", True) == "cuda_ipc"
    assert default_backend("cuda", False) == "torch_distributed"


# ---------------------------------------------------------------- end to end, server in another process


def _server_main(device, ready, events, stop):
    """D side: two servers whose callbacks report to the test through `events`."""

    def on_header(m):
        events.put(("header", m.request_id))
        if "reject" in m.meta:
            raise TransferRejected(m.meta["reject"])

    def on_payload(m, flat):
        if "fail_install" in m.meta:
            raise RuntimeError(m.meta["fail_install"])
        assert flat.device.type == torch.device(device).type
        events.put(("payload", m.request_id, {n: _raw(v) for n, v in unpack(flat, m.specs).items()}))

    servers = [TransferServer("127.0.0.1", 0, device, on_header, on_payload, timeout=10).start() for _ in range(2)]
    ready.put([s.address for s in servers])
    stop.wait(120)
    for s in servers:
        s.stop()


class Remote:
    def __init__(self, addresses, events):
        self.addresses = addresses
        self.events = events
        self.headers: set[str] = set()
        self.payloads: dict[str, dict] = {}

    def payload(self, rid: str, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while rid not in self.payloads:
            ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if ev[0] == "header":
                self.headers.add(ev[1])
            else:
                self.payloads[ev[1]] = ev[2]
        return self.payloads[rid]


def _spawn_remote(device):
    ctx = mp.get_context("spawn")
    ready, events, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_server_main, args=(device, ready, events, stop), daemon=True)
    proc.start()
    try:
        yield Remote(ready.get(timeout=60), events)
    finally:
        stop.set()
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@pytest.fixture(scope="module")
def remote():
    yield from _spawn_remote("cpu")


@pytest.fixture
def client_factory():
    made = []

    def make(backend, device="cpu"):
        c = TransferClient(backend, device)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _check_same(got: dict, state):
    assert set(got) == {n for n, _ in state}
    for name, t in state:
        assert got[name] == _raw(t), name


def _several_transfers(remote, client, tag, device="cpu"):
    address = remote.addresses[0]
    for i, scale in enumerate([1, 3, 2, 5]):  # sizes grow and shrink on one connection
        state = _state(100 + i, scale, device)
        flat, specs = pack(state)
        n, secs = client.send(address, _manifest(f"{tag}-{i}", flat, specs), flat)
        assert n == flat.numel() and secs >= 0
        _check_same(remote.payload(f"{tag}-{i}"), state)
    # a transfer without a checksum, and one with nothing in it
    state = _state(7, 1, device)
    flat, specs = pack(state)
    client.send(address, _manifest(f"{tag}-nock", flat, specs, with_checksum=False), flat)
    _check_same(remote.payload(f"{tag}-nock"), state)
    flat, specs = pack([("empty", torch.empty(0, device=device))])
    client.send(address, _manifest(f"{tag}-empty", flat.to(device), specs), flat.to(device))
    _check_same(remote.payload(f"{tag}-empty"), [("empty", torch.empty(0))])
    assert len(client._peers) == 1 and client._peers[address].ch is not None  # one persistent connection


def _rejections(remote, client, tag, device="cpu"):
    address = remote.addresses[0]
    state = _state(9, 1, device)
    flat, specs = pack(state)
    with pytest.raises(TransferRejected, match="lease expired for r-9"):
        client.send(address, _manifest(f"{tag}-rej", flat, specs, reject="lease expired for r-9"), flat)
    bad = flat.clone()
    bad[specs[0].offset + 5] ^= 0x10  # one bit flipped after P computed the checksum
    with pytest.raises(TransferRejected, match="checksum"):
        client.send(address, _manifest(f"{tag}-corrupt", flat, specs), bad)
    with pytest.raises(TransferRejected, match="no free slot"):
        client.send(address, _manifest(f"{tag}-install", flat, specs, fail_install="no free slot"), flat)
    # the same connection keeps working, and D saw the headers but installed none of the refused ones
    client.send(address, _manifest(f"{tag}-after", flat, specs), flat)
    _check_same(remote.payload(f"{tag}-after"), state)
    assert {f"{tag}-rej", f"{tag}-corrupt", f"{tag}-install"} <= remote.headers
    assert not {f"{tag}-rej", f"{tag}-corrupt", f"{tag}-install"} & set(remote.payloads)


def _concurrent(remote, make_client, backend, tag, device="cpu"):
    clients = [make_client(backend, device) for _ in range(2)]
    jobs = []  # (client, address, request id): two clients to one D, and one client to two Ds at once
    for k in range(3):
        jobs.append((clients[0], remote.addresses[0], f"{tag}-a{k}"))
        jobs.append((clients[1], remote.addresses[0], f"{tag}-b{k}"))
        jobs.append((clients[1], remote.addresses[1], f"{tag}-c{k}"))
    states, errors = {}, []

    def run(c, address, rid, seed):
        try:
            state = _state(seed, 1 + seed % 3, device)
            states[rid] = state
            flat, specs = pack(state)
            c.send(address, _manifest(rid, flat, specs), flat)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c, a, rid, 200 + i)) for i, (c, a, rid) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for _, _, rid in jobs:
        _check_same(remote.payload(rid), states[rid])


CPU_BACKENDS = ["tcp", "torch_distributed"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_several_transfers_on_one_connection(remote, client_factory, backend):
    _several_transfers(remote, client_factory(backend), f"many-{backend}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rejections_reach_the_client(remote, client_factory, backend):
    _rejections(remote, client_factory(backend), f"rej-{backend}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_concurrent_clients(remote, client_factory, backend):
    _concurrent(remote, client_factory, backend, f"conc-{backend}")


def _frame(obj) -> bytes:
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


def _read_frame(sock) -> dict:
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    (n,) = struct.unpack(">I", exact(4))
    return json.loads(exact(n))


def test_server_survives_bad_peers(remote, client_factory):
    host, port = remote.addresses[0].rsplit(":", 1)
    state = _state(11)
    flat, specs = pack(state)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(_frame(b"{nope"))
        assert _read_frame(s)["ok"] is False
        s.sendall(_frame({"type": "transfer", "backend": "carrier-pigeon"}))
        assert "unknown backend" in _read_frame(s)["error"]
        s.sendall(_frame({"type": "transfer", "backend": "tcp", "manifest": {"request_id": 1}}))
        assert "manifest" in _read_frame(s)["error"]
        s.sendall(_frame({"type": "dist_goodbye", "backend": "torch_distributed"}))
        assert _read_frame(s)["ok"] is False
        s.sendall(struct.pack(">I", 1 << 30))  # oversized frame: the server drops the connection
        s.settimeout(5)
        assert s.recv(1) == b""
    with socket.create_connection((host, int(port)), timeout=5) as s:  # dies halfway through a payload
        header = {"type": "transfer", "backend": "tcp", "manifest": _manifest("dropped", flat, specs).to_dict()}
        s.sendall(_frame(header))
        assert _read_frame(s)["ok"] is True
        s.sendall(flat[: flat.numel() // 2].numpy().tobytes())
    client = client_factory("tcp")
    client.send(remote.addresses[0], _manifest("survivor", flat, specs), flat)
    _check_same(remote.payload("survivor"), state)
    assert "dropped" not in remote.payloads


def test_client_errors():
    flat, specs = pack(_state(12))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    client = TransferClient("tcp", "cpu")
    try:
        with pytest.raises(TransferError) as ei:
            client.send(dead, _manifest("x", flat, specs), flat, timeout=2)
        assert not isinstance(ei.value, TransferRejected)
        with pytest.raises(TransferError, match="bytes"):
            client.send(dead, _manifest("x", flat, specs), flat[:-1])
    finally:
        client.close()
    with pytest.raises(ValueError):
        TransferClient("smoke-signals", "cpu")


def test_client_times_out_on_silent_server():
    # A listener that accepts but never answers: the client gives up after its timeout.
    with socket.create_server(("127.0.0.1", 0)) as srv:
        address = f"127.0.0.1:{srv.getsockname()[1]}"
        flat, specs = pack(_state(13))
        client = TransferClient("tcp", "cpu")
        t0 = time.monotonic()
        try:
            with pytest.raises(TransferError, match="timed out"):
                client.send(address, _manifest("slow", flat, specs), flat, timeout=0.5)
        finally:
            client.close()
        assert time.monotonic() - t0 < 5


def test_in_process_server_stop_is_bounded():
    calls = queue.Queue()
    server = TransferServer("127.0.0.1", 0, "cpu", lambda m: None, lambda m, f: calls.put(m.request_id)).start()
    client = TransferClient("torch_distributed", "cpu")
    try:
        state = _state(14)
        flat, specs = pack(state)
        client.send(server.address, _manifest("inproc", flat, specs), flat)
        assert calls.get(timeout=5) == "inproc"
    finally:
        t0 = time.monotonic()
        server.stop()  # with an idle connection and a live process group still open
        client.close()
        assert time.monotonic() - t0 < 6


# ---------------------------------------------------------------- GPU (run later with -m gpu)


@pytest.fixture(scope="module")
def remote_cuda():
    yield from _spawn_remote("cuda:0")


@pytest.mark.gpu
def test_checksum_cpu_equals_cuda():
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=G)
    assert checksum(data) == checksum(data.cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda_ipc", "tcp"])
def test_cuda_same_gpu_two_processes(remote_cuda, client_factory, backend):
    client = client_factory(backend, "cuda:0")
    _several_transfers(remote_cuda, client, f"gpu-many-{backend}", "cuda:0")
    _rejections(remote_cuda, client, f"gpu-rej-{backend}", "cuda:0")
    _concurrent(remote_cuda, client_factory, backend, f"gpu-conc-{backend}", "cuda:0")


@pytest.mark.gpu
def test_torch_distributed_gloo_from_cuda_payload(remote, client_factory):
    # P on CUDA, D on CPU: the pair falls back to gloo and stages through host memory.
    client = client_factory("torch_distributed", "cuda:0")
    _several_transfers(remote, client, "gpu-gloo", "cuda:0")


@pytest.fixture(scope="module")
def remote_cuda1():
    yield from _spawn_remote("cuda:1")


@pytest.mark.gpu
def test_torch_distributed_nccl_two_gpus(client_factory, request):
    # NCCL refuses two ranks on one GPU, so the NCCL pair needs D on a second device.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    remote = request.getfixturevalue("remote_cuda1")
    client = client_factory("torch_distributed", "cuda:0")
    _several_transfers(remote, client, "nccl-many", "cuda:0")
    _rejections(remote, client, "nccl-rej", "cuda:0")
    _concurrent(remote, client_factory, "torch_distributed", "nccl-conc", "cuda:0")
