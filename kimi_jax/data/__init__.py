"""Input pipeline: documents from a source (sources.py) packed into rows with segment ids
(packing.py). `make_iterator(config, split)` gives this host's share of each global batch."""

from __future__ import annotations

import jax

from kimi_jax.data.packing import PackedBatches
from kimi_jax.data.sources import documents, make_task
from kimi_jax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, make_tokenizer


def data_vocab_size(config) -> int:
    """Token ids the data can contain (the model's vocabulary must be at least this)."""
    if config.data.kind in ("task", "tfds_task"):
        return make_task(config.data).vocab_size
    return make_tokenizer(config.data).vocab_size


def sequence_length(config) -> int:
    """`data.seq_len`, or the task's own length when it is 0."""
    if config.data.seq_len:
        return int(config.data.seq_len)
    if config.data.kind in ("task", "tfds_task"):
        return int(make_task(config.data).seq_len)
    raise ValueError(f"data.seq_len must be set for data.kind={config.data.kind!r}")


def host_batch_size(config) -> int:
    """This host's rows of the global `data.batch_size`."""
    batch, hosts = int(config.data.batch_size), jax.process_count()
    if batch % hosts:
        raise ValueError(f"data.batch_size={batch} is not divisible by the {hosts} processes")
    return batch // hosts


def make_iterator(config, split: str) -> PackedBatches:
    """Resumable iterator of host-local batches {inputs, targets, segment_ids, loss_mask} [b, T]."""
    kind = config.data.kind
    tokenizer = make_tokenizer(config.data) if kind in ("tfds", "files") else None
    return PackedBatches(documents(config, split, tokenizer), sequence_length(config), host_batch_size(config),
                         name=f"{kind}:{split}")


__all__ = ["ByteTokenizer", "PackedBatches", "SentencePieceTokenizer", "data_vocab_size", "documents",
           "host_batch_size", "make_iterator", "make_tokenizer", "sequence_length"]
