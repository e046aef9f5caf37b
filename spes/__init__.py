"""spes: decentralized MoE pretraining with SPES (arXiv 2602.11543)."""

import os

# NOTE: set before torch's first CPU allocation, which reads it once: CPU tensors of 2 MiB and more get 2 MiB pages
# (PyTorch's own switch, c10's CPU allocator), so a fresh large tensor costs a page fault per 2 MiB, not per 4 KiB.
# The codecs and the server make fresh model-sized tensors every round; measured in bench/bench_codec.py.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# NOTE: set before grpc is first imported, which reads it once: gRPC's core logs a line of its own (`I1206 ...
# ssl_transport_security.cc ... Handshake failed`) for every connection whose TLS handshake fails, so anyone who
# reaches a TLS server's port wrote a line per connection into its log, past the throttled warnings, and a node
# with a wrong certificate printed it above its one-line error. Its errors still print; GRPC_VERBOSITY=INFO (or
# DEBUG, with GRPC_TRACE) in the environment brings the rest back.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__version__ = "0.1.0"
