"""Server reflection as grpc.reflection.v1 (what newer grpcurl asks for) beside v1alpha.

grpcio-reflection implements v1alpha only. v1 is the same protocol under another package name (same messages,
same field numbers), so the v1alpha servicer answers both; the v1 file descriptor, derived from v1alpha's, is
registered so that reflection can describe the v1 service too."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA = reflection.SERVICE_NAME
V1 = "grpc.reflection.v1.ServerReflection"
SERVICE_NAMES = (V1, V1ALPHA)


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1)
        return
    except KeyError:
        pass
    fd = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fd)
    old, new = f".{fd.package}.", ".grpc.reflection.v1."
    fd.name, fd.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    fd.ClearField("options")  # v1alpha's language options (java package, go path) name v1alpha
    for message in fd.message_type:
        for f in message.field:
            if f.type_name:  # only message fields have one (setting "" would make it present)
                f.type_name = f.type_name.replace(old, new)
    for service in fd.service:
        for m in service.method:
            m.input_type, m.output_type = m.input_type.replace(old, new), m.output_type.replace(old, new)
    pool.Add(fd)


def add_reflection(server: grpc.Server, service_names: list[str]) -> None:
    """Serves both reflection versions on `server`, listing `service_names` and themselves."""
    _register_v1_descriptor()
    servicer = reflection.ReflectionServicer([*service_names, *SERVICE_NAMES])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": v1}),))
