"""Greedy packing of documents into fixed-length rows with `segment_ids`, as a resumable iterator.

A document is a dict of `inputs`, `targets` (the next token at each position, inside the
document) and `loss_mask`, each [n]. Documents are placed one after another in rows of
`seq_len`; a document that does not fit in what is left of a row starts the next row, and one
longer than a row is split over several rows. Each piece gets its own segment id (1, 2, ...;
0 is padding), so the model never lets packed documents see each other, and targets never cross
a document boundary because they come from the document itself.

The iterator's whole state is (next document index, offset inside it): a row is a function of
that pair, so a restored iterator gives exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import functools

import numpy as np

FIELDS = ("inputs", "targets", "loss_mask", "segment_ids")


class PackedBatches:
    """Iterator of batches {inputs, targets, segment_ids [B, T] int32, loss_mask [B, T] bool} over
    a random-access sequence of documents (anything with `__getitem__`, e.g. a grain MapDataset)."""

    def __init__(self, documents, seq_len: int, batch_size: int, *, name: str = "data"):
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(f"seq_len and batch_size must be positive, got {seq_len=}, {batch_size=}")
        self.documents, self.seq_len, self.batch_size, self.name = documents, seq_len, batch_size, name
        self._doc, self._offset = 0, 0
        self._cache = (None, None)

    def get_state(self) -> dict:
        return {"doc": int(self._doc), "offset": int(self._offset)}

    def set_state(self, state: dict) -> None:
        self._doc, self._offset = int(state["doc"]), int(state["offset"])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = [self._next_row() for _ in range(self.batch_size)]
        return {k: np.stack([r[k] for r in rows]) for k in FIELDS}

    @staticmethod
    @functools.cache
    def _ones(T: int) -> np.ndarray:
        out = np.ones(T, np.int32)
        out.flags.writeable = False  # shared by every such row; np.stack copies it
        return out

    def _document(self, index: int) -> dict:
        if self._cache[0] != index:
            try:
                doc = self.documents[index]
            except IndexError:
                raise StopIteration from None
            self._cache = (index, doc)
        return self._cache[1]

    def _next_row(self) -> dict:
        T = self.seq_len
        if self._offset == 0:  # a whole document of exactly one row (every synthetic task): no copy
            doc = self._document(self._doc)
            if len(doc["inputs"]) == T:
                self._doc += 1
                return {"inputs": np.asarray(doc["inputs"], np.int32), "targets": np.asarray(doc["targets"], np.int32),
                        "loss_mask": np.asarray(doc["loss_mask"], bool), "segment_ids": self._ones(T)}
        row = {k: np.zeros(T, bool if k == "loss_mask" else np.int32) for k in FIELDS}
        pos, segment = 0, 0
        while pos < T:
            doc = self._document(self._doc)
            n = len(doc["inputs"]) - self._offset
            if n <= 0:  # empty document or finished
                self._doc, self._offset = self._doc + 1, 0
                continue
            if pos > 0 and n > T - pos and n <= T:
                break  # fits in a fresh row: do not split it
            take = min(n, T - pos)
            sl = slice(self._offset, self._offset + take)
            for k in ("inputs", "targets", "loss_mask"):
                row[k][pos:pos + take] = doc[k][sl]
            segment += 1
            row["segment_ids"][pos:pos + take] = segment
            pos += take
            if take < n:
                self._offset += take
            else:
                self._doc, self._offset = self._doc + 1, 0
        return row
