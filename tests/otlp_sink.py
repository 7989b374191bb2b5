"""A minimal OTLP/gRPC trace receiver for tests: every span it is sent becomes one JSON line.

Usage: otlp_sink.py PORT OUT.jsonl

Implements opentelemetry.proto.collector.trace.v1.TraceService/Export (from the PyPI packages
opentelemetry-proto and grpcio) on 127.0.0.1:PORT, prints "listening" once it accepts, and appends
to OUT.jsonl, flushed after each export: {"service", "name", "kind", "trace_id", "span_id",
"parent_span_id", "start_ns", "end_ns", "status", "attributes"} with ids in lowercase hex.
"""

import json
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def value(v):
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out):
        self.out = out
        self.lock = threading.Lock()

    def Export(self, request, context):
        lines = []
        for rs in request.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    lines.append(json.dumps({
                        "service": resource.get("service.name"),
                        "name": s.name,
                        "kind": s.kind,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "status": s.status.code,
                        "attributes": {kv.key: value(kv.value) for kv in s.attributes},
                    }))
        with self.lock:
            for line in lines:
                self.out.write(line + "\n")
            self.out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    port, path = int(sys.argv[1]), sys.argv[2]
    out = open(path, "a", encoding="utf-8")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(out), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("listening", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
