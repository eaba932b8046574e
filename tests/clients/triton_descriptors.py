"""Dump tritonclient's own message descriptors as JSON (tritonclient.grpc and kserve cannot share
one process): {full message name: {field name: [number, type, label, message or enum type]}}.

usage: python -m tests.clients.triton_descriptors NAME...
"""

from __future__ import annotations

import json
import sys

from google.protobuf.descriptor import Descriptor
from tritonclient.grpc import model_config_pb2, service_pb2


def fields(message: Descriptor) -> dict[str, list]:
    out = {}
    for field in message.fields:
        kind = field.message_type or field.enum_type
        out[field.name] = [field.number, field.type, field.label, kind.full_name if kind else ""]
    return out


def main() -> None:
    pools = [service_pb2.DESCRIPTOR, model_config_pb2.DESCRIPTOR]
    out = {}
    for name in sys.argv[1:]:
        descriptor = pools[0].pool.FindMessageTypeByName(name)
        out[name] = fields(descriptor)
    enum = model_config_pb2.DESCRIPTOR.enum_types_by_name["DataType"]
    out["inference.DataType"] = {v.name: v.number for v in enum.values}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
