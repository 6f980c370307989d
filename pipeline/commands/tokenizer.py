"""`fucina tokenizer train`: a byte-level BPE (Hugging Face tokenizers) that llama.cpp tokenizes the same."""
from __future__ import annotations

import os

from ..errors import UserError

NAME = "tokenizer"
HELP = "train a byte-level BPE tokenizer (tokenizer.json) on text, directories, globs or JSONL"
DESCRIPTION = ("Train a byte-level BPE with Hugging Face tokenizers on the training documents of --data (the "
               "held-out split the pretrain job uses is left out), with the pre-tokenizer regex of a "
               "pre-tokenizer llama.cpp knows (qwen2 or llama-bpe) and the ChatML special tokens, and write "
               "tokenizer.json. `fucina pretrain --tokenizer FILE` uses it; every exported GGUF embeds it.")


def add_arguments(parser):
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("train", help="train tokenizer.json", description=DESCRIPTION,
                       formatter_class=parser.formatter_class)
    p.add_argument("--data", default="", help="text files, directories, globs or JSONL, comma-separated "
                                              "(empty: the built-in corpus of CPython's docs and sources)")
    p.add_argument("--text-field", default="text", help="the string field of each JSONL record")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary, specials included")
    p.add_argument("--pre", default="qwen2", choices=("qwen2", "llama-bpe"),
                   help="llama.cpp pre-tokenizer whose split the BPE learns on (tokenizer.ggml.pre)")
    p.add_argument("--val-share", type=float, default=0.02, help="share of the corpus bytes held out, as pretrain")
    p.add_argument("--out", default="tokenizer.json", help="where to write the tokenizer")


def run(args) -> int:
    from ..jobs.pretrain_data import load_corpus
    from ..llm import bpe_train
    from ._args import check_corpus_files
    if os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a directory, not a file")
    check_corpus_files(args.data)  # FIFOs, devices and over-long lines refused before the corpus is read
    corpus = load_corpus(args.data, args.text_field, args.val_share)
    tok = bpe_train.train_bpe(corpus.train_docs, args.vocab_size, args.pre)
    bpe_train.save_tokenizer(tok, args.out)
    _, _, digest = bpe_train.load_tokenizer(args.out)
    print(f"{args.out}: {tok.get_vocab_size()} tokens ({args.pre} split), trained on {len(corpus.train_docs)} "
          f"documents of corpus {corpus.digest} ({corpus.source}); tokenizer digest {digest}")
    return 0
