#!/usr/bin/env python3
"""Run llama.cpp's convert_hf_to_gguf.py on a checkpoint from make_checkpoint.py, unchanged, with one
override: the BPE pre-tokenizer is declared `glm4` (what the real GLM-5.3-Flash tokenizer hashes to).

Usage:  python3 e2e/peers/convert.py LLAMA_CPP_DIR CHECKPOINT_DIR [convert_hf_to_gguf.py options...]
  e.g.  python3 e2e/peers/convert.py .peers/llama.cpp /tmp/ck --outtype bf16 --outfile m.gguf --no-mtp

The converter identifies a tokenizer's pre-tokenizer by hashing how it splits a test string and
refuses one it does not know; our random tokenizer (make_checkpoint.py) is not one it knows, and its
merges never cross the pre-tokenizer's word boundaries, so the choice does not change any token id
we feed (ids go in as ids). The override replaces TextModel.get_vocab_base_pre in this process
only; no file of llama.cpp is edited.
"""

import os
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    lc, ckpt, rest = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3:]
    sys.path[:0] = [lc, os.path.join(lc, "gguf-py")]
    import convert_hf_to_gguf as conv  # noqa: E402  (from LLAMA_CPP_DIR)
    from conversion.base import TextModel  # noqa: E402

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
    sys.argv = [os.path.join(lc, "convert_hf_to_gguf.py"), ckpt, *rest]
    conv.main()


if __name__ == "__main__":
    main()
