"""TLS and mTLS on every link of `tandem serve` (client -> router, router -> workers, the P -> D hand-off control
socket, HTTPS): the cluster serves with certificates from one CA; connections without a certificate, with one
from another CA, or in plain text are refused. Also: no pickle in any module that reads bytes off the wire."""

import datetime
import ipaddress
import pathlib
import socket
import ssl
import struct

import grpc
import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cluster import Cluster, assert_idle
from tandem import SamplingParams
from tandem.client import TandemClient
from tandem.rpc import worker_pb2, worker_pb2_grpc
from tandem.rpc.auth import with_internal_token
from tandem.rpc.convert import sampling_to_proto
from tandem.rpc.server import Tls

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(directory: pathlib.Path, tag: str):
    """A CA and one leaf for 127.0.0.1/localhost signed by it (server and client use), as PEM files."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"{tag} CA")).issuer_name(_name(f"{tag} CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(_name(f"{tag} tandem")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {k: directory / f"{tag}-{k}.pem" for k in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return Tls(str(paths["cert"]), str(paths["key"]), str(paths["ca"]))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return make_ca(d, "good"), make_ca(d, "rogue")


@pytest.fixture(scope="module")
def cluster(pki):
    good, _ = pki
    c = Cluster("--model", "tiny-moe", "--prefill-workers", "1", "--decode-workers", "1", "--tls-cert", good.cert,
                "--tls-key", good.key, "--tls-ca", good.ca, tls=good)
    yield c
    assert c.stop() == 0


PARAMS = SamplingParams(max_tokens=5, temperature=0.0)


def refused(call) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value


def test_mtls_cluster_serves_and_refuses_other_clients(cluster, pki):
    good, rogue = pki
    assert len(cluster.client.generate_unary([1, 2, 3], PARAMS, timeout=60).token_ids) == 5  # every hop is TLS
    for tls in (None, Tls(ca=good.ca), rogue, Tls(rogue.cert, rogue.key, good.ca)):
        # plain text; TLS without a client certificate; a foreign CA; a foreign client certificate
        with TandemClient(cluster.address, tls=tls) as client:
            refused(lambda: client.generate_unary([1, 2, 3], PARAMS, timeout=10))
    assert_idle(cluster)


def test_workers_refuse_clients_without_a_certificate(cluster, pki):
    good, rogue = pki
    for address in cluster.workers.values():
        for tls in (None, Tls(ca=good.ca), Tls(rogue.cert, rogue.key, good.ca)):
            ch = grpc.insecure_channel(address) if tls is None else grpc.secure_channel(
                address, tls.channel_credentials())
            with ch:
                refused(lambda: worker_pb2_grpc.DecodeWorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=10))


def test_handoff_socket_refuses_plain_and_unauthenticated_peers(cluster, pki):
    good, rogue = pki
    decode = cluster.workers["decode-0"]
    with grpc.secure_channel(decode, good.channel_credentials()) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(with_internal_token(ch, cluster.internal_token))
        lease = stub.Reserve(worker_pb2.ReserveRequest(request_id="tls-probe", prompt_token_ids=[1, 2, 3],
                                                       sampling=sampling_to_proto(PARAMS)), timeout=10)
        try:
            host, port = lease.transfer_address.rsplit(":", 1)
            # plain text: a JSON frame gets no answer; the TLS server drops the connection
            with socket.create_connection((host, int(port)), timeout=10) as s:
                frame = b'{"type":"transfer","backend":"tcp"}'
                s.sendall(struct.pack(">I", len(frame)) + frame)
                try:
                    reply = s.recv(4096)
                except ConnectionResetError:
                    reply = b""
                assert not reply.startswith(b"\x00"), reply  # a TLS alert or nothing, never a framed answer
            for tls in (Tls(ca=good.ca), Tls(rogue.cert, rogue.key, good.ca)):
                with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
                    with socket.create_connection((host, int(port)), timeout=10) as raw:
                        with tls.client_context().wrap_socket(raw, server_hostname=host) as s:
                            s.sendall(struct.pack(">I", 2) + b"{}")
                            if not s.recv(4096):  # TLS 1.3: the refusal arrives after the handshake
                                raise ConnectionError("closed")
            with socket.create_connection((host, int(port)), timeout=10) as raw:  # the right certificate works
                with good.client_context().wrap_socket(raw, server_hostname=host) as s:
                    s.sendall(struct.pack(">I", 2) + b"{}")
                    (n,) = struct.unpack(">I", s.recv(4))
                    assert b"unknown backend" in s.recv(n)
        finally:
            stub.Abort(worker_pb2.WorkerAbortRequest(request_id="tls-probe"), timeout=10)
    assert_idle(cluster)


def test_https_endpoint(cluster, pki):
    good, _ = pki
    url = f"https://{cluster.http}"
    body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0}
    r = requests.post(url + "/v1/completions", json=body, verify=good.ca, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post(f"http://{cluster.http}/v1/completions", json=body, timeout=10)


def test_no_pickle_on_any_wire():
    """Bytes from the network are parsed as protobuf, JSON or raw tensor bytes; never unpickled."""
    modules = [*ROOT.glob("router/*.py"), *ROOT.glob("prefill_worker/*.py"), *ROOT.glob("decode_worker/*.py"),
               *ROOT.glob("tandem/transfer/*.py"), *ROOT.glob("tandem/rpc/*.py"), ROOT / "tandem/client.py"]
    assert len(modules) > 15
    for path in modules:
        text = path.read_text()
        for needle in ("import pickle", "from pickle", "cPickle", "torch.load(", "marshal.loads", "dill"):
            assert needle not in text, (path, needle)
