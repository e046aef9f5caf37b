"""Generated gRPC stubs for protos/spes.proto (run_scripts/gen_protos.sh); do not edit by hand."""

from . import spes_pb2, spes_pb2_grpc

__all__ = ["spes_pb2", "spes_pb2_grpc"]
