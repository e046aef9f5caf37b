"""spes: decentralized MoE pretraining with SPES (arXiv 2602.11543)."""

__version__ = "0.1.0"
