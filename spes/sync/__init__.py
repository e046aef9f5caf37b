"""The SPES synchronization path: wire format, merge math, gRPC server and client."""
