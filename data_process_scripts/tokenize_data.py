#!/usr/bin/env python
"""Tokenize text corpora into the flat token shards that spes trains on (`spes.corpus`; --help for the flags).

    python data_process_scripts/tokenize_data.py --file_glob 'raw/*.jsonl.zst' \
        --tokenizer_name_or_path data/default/tokenizer --output_prefix tokens/part --processes 2
"""

import sys

from spes.corpus import tokenize_main

if __name__ == "__main__":
    sys.exit(tokenize_main())
