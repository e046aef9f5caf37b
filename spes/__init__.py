"""spes: decentralized MoE pretraining with SPES (arXiv 2602.11543)."""

import os

# NOTE: set before torch's first CPU allocation, which reads it once: CPU tensors of 2 MiB and more get 2 MiB pages
# (PyTorch's own switch, c10's CPU allocator), so a fresh large tensor costs a page fault per 2 MiB, not per 4 KiB.
# The codecs and the server make fresh model-sized tensors every round; measured in bench/bench_codec.py.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
