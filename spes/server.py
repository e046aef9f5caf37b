"""Entry point `python -m spes.server`: the SPES parameter server (implemented in `spes.sync.server`)."""

from spes.sync.server import main

if __name__ == "__main__":
    raise SystemExit(main())
