#!/usr/bin/env python
"""Build spes's default training corpus (`spes.default_corpus`; --help for the flags).

python data_process_scripts/build_default_corpus.py --output_dir data/default [--max_mb 24] [--overwrite]
"""

import sys

from spes.default_corpus import main

if __name__ == "__main__":
    sys.exit(main())
