"""Corpora, tokenizers and the distributed batch loader."""

from loomtrain.data.build import Data, build_data, resolve_vocab
from loomtrain.data.corpus import check_data_files, load_corpus, read_text_file, shakespeare_plays
from loomtrain.data.loader import DistributedBatchLoader, eval_batches
from loomtrain.data.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    build_tokenizer,
    encode_to_tensor,
    load_tokenizer,
)

__all__ = [
    "BPETokenizer",
    "CharTokenizer",
    "Data",
    "DistributedBatchLoader",
    "Tokenizer",
    "build_data",
    "build_tokenizer",
    "check_data_files",
    "encode_to_tensor",
    "eval_batches",
    "load_corpus",
    "load_tokenizer",
    "read_text_file",
    "resolve_vocab",
    "shakespeare_plays",
]
