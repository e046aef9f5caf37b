#!/usr/bin/env python
"""Train a byte-level BPE tokenizer on local text as a Hugging Face tokenizer directory (`spes.corpus`).

    python data_process_scripts/train_tokenizer.py --input 'corpus/*.jsonl.gz' 'notes/**/*.md' \
        --output_dir my_tokenizer --vocab_size 4096
"""

import sys

from spes.corpus import train_tokenizer_main

if __name__ == "__main__":
    sys.exit(train_tokenizer_main())
