"""Tokenizers for real text: UTF-8 bytes, or a SentencePiece model file."""

from __future__ import annotations

import os

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids: pad 0, bos 1, eos 2; vocab 259."""

    pad_id, bos_id, eos_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.offset

    def decode(self, ids) -> str:
        ids = np.asarray(ids, np.int64)
        data = (ids[ids >= self.offset] - self.offset).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A trained SentencePiece `.model` file (the `sentencepiece` package)."""

    def __init__(self, path: str):
        import sentencepiece as spm

        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"SentencePiece model file {path!r} (data.tokenizer_path) does not exist")
        self.path = path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"SentencePiece model file {path!r} could not be loaded: {e}") from e
        self.vocab_size = int(self._sp.GetPieceSize())
        self.pad_id = int(self._sp.pad_id())
        self.bos_id = int(self._sp.bos_id())
        self.eos_id = int(self._sp.eos_id())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.EncodeAsIds(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


def make_tokenizer(data_config):
    """The tokenizer named by `data.tokenizer` ("byte" or "sentencepiece")."""
    kind = data_config.tokenizer
    if kind == "byte":
        return ByteTokenizer()
    if kind == "sentencepiece":
        return SentencePieceTokenizer(data_config.tokenizer_path)
    raise ValueError(f"Unknown data.tokenizer={kind!r}; expected one of byte, sentencepiece")


def text_to_document(tokenizer, text) -> dict:
    """One document as next-token pairs: bos + tokens + eos, inputs [n] and targets [n] shifted by one."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    ids = tokenizer.encode(text)
    head = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    tail = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
    ids = np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)])
    return {"inputs": ids[:-1], "targets": ids[1:], "loss_mask": np.ones(max(len(ids) - 1, 0), bool)}
