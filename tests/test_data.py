"""The input pipeline: packing never leaks across documents, resumable iterators, synthetic tasks,
the TFDS array_record builder, text files, tokenizers, and errors that name missing data."""

import io
import json

import numpy as np
import pytest

from configs import common
from kimi_jax import data
from kimi_jax.data import build, sources, tfds_tasks
from kimi_jax.data.packing import PackedBatches
from kimi_jax.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, text_to_document


def _docs(rng, n=40, max_len=30):
    """Documents whose tokens encode (document id, position) so leaks are detectable."""
    out = []
    for d in range(n):
        L = int(rng.integers(0, max_len))
        tokens = 1000 * (d + 1) + np.arange(L + 1, dtype=np.int32)
        out.append({"inputs": tokens[:-1], "targets": tokens[1:], "loss_mask": np.ones(L, bool)})
    return out


@pytest.mark.parametrize("seq_len", [8, 16, 37])
def test_packing_never_leaks_across_documents(rng, seq_len):
    docs = _docs(rng)
    it = PackedBatches(docs, seq_len, batch_size=3)
    seen = []
    with pytest.raises(StopIteration):
        while True:
            batch = next(it)
            for row in range(3):
                seg, inp, tgt, mask = (batch[k][row] for k in ("segment_ids", "inputs", "targets", "loss_mask"))
                assert np.all(np.diff(seg[seg > 0]) >= 0) and np.all(seg[:np.count_nonzero(seg)] > 0)
                assert not mask[seg == 0].any() and not inp[seg == 0].any()
                for s in np.unique(seg[seg > 0]):
                    piece_in, piece_tgt = inp[seg == s], tgt[seg == s]
                    assert len(set(piece_in // 1000)) == 1  # one document per segment
                    np.testing.assert_array_equal(piece_tgt, piece_in + 1)  # targets inside it
                    assert np.all(np.diff(piece_in) == 1)  # contiguous, in order
                    seen.append(piece_in)
    # every token of every document appears exactly once, in order
    expected = np.concatenate([d["inputs"] for d in docs])
    got = np.concatenate(seen)
    np.testing.assert_array_equal(got[:len(expected)], expected[:len(got)])
    assert len(expected) - len(got) < 3 * seq_len  # only the unfinished last batch is dropped


def test_packing_keeps_short_documents_whole(rng):
    docs = _docs(rng, max_len=10)
    batch = next(PackedBatches(docs, 16, batch_size=4))
    for row in range(4):
        seg, inp = batch["segment_ids"][row], batch["inputs"][row]
        for s in np.unique(seg[seg > 0]):
            d = inp[seg == s][0] // 1000 - 1
            assert len(inp[seg == s]) == len(docs[d]["inputs"])


def test_iterator_state_resumes_exactly(rng):
    docs = _docs(rng, n=200)
    a = PackedBatches(docs, 16, batch_size=2)
    for _ in range(5):
        next(a)
    state = json.loads(json.dumps(a.get_state()))
    expected = [next(a) for _ in range(3)]
    b = PackedBatches(docs, 16, batch_size=2)
    b.set_state(state)
    for want in expected:
        got = next(b)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_whole_row_documents_are_rows_of_their_own(rng):
    """Documents of exactly seq_len tokens (every synthetic task's) fill a row each, with the
    greedy rule around them unchanged: hand-worked rows for lengths 16, 5, 16, 3, 4, 16 at T = 16."""
    lengths = [16, 5, 16, 3, 4, 16]
    docs = [{"inputs": np.arange(n, dtype=np.int64) + 100 * d, "targets": np.arange(n) + 100 * d + 1,
             "loss_mask": np.ones(n, bool)} for d, n in enumerate(lengths)]
    batch = next(PackedBatches(docs, 16, batch_size=5))
    assert batch["inputs"].dtype == np.int32 and batch["segment_ids"].dtype == np.int32
    pad = lambda *parts: np.concatenate(list(parts) + [np.zeros(16 - sum(map(len, parts)), int)])  # noqa: E731
    want_in = [docs[0]["inputs"], pad(docs[1]["inputs"]), docs[2]["inputs"],
               pad(docs[3]["inputs"], docs[4]["inputs"]), docs[5]["inputs"]]
    want_seg = [[1] * 16, [1] * 5 + [0] * 11, [1] * 16, [1] * 3 + [2] * 4 + [0] * 9, [1] * 16]
    np.testing.assert_array_equal(batch["inputs"], np.stack(want_in))
    np.testing.assert_array_equal(batch["segment_ids"], np.array(want_seg))
    batch["segment_ids"][0, 0] = 7  # the batch is a copy: later rows still read 1
    assert next(PackedBatches(docs, 16, batch_size=1))["segment_ids"][0, 0] == 1


def test_task_source_shard_is_grain_slicing():
    """A host's share of an on-the-fly task (TaskSource shard) is exactly what grain's slice of the
    whole stream gives, so the data of a run does not depend on which of the two builds it."""
    import grain

    task = sources.make_task(_task_config().data)
    whole = sources.TaskSource(task, 3, "train", block_size=8)
    for index, count in ((0, 1), (1, 3), (2, 3)):
        share = sources.TaskSource(task, 3, "train", block_size=8, shard=(index, count))
        ref = grain.MapDataset.source(whole)[index::count]
        for i in (0, 1, 5, 17):
            for k in ("inputs", "targets", "loss_mask"):
                np.testing.assert_array_equal(share[i][k], ref[i][k])
                np.testing.assert_array_equal(share[i][k], whole[index + i * count][k])
    with pytest.raises(ValueError, match="shard"):
        sources.TaskSource(task, 3, "train", shard=(3, 3))
    with pytest.raises(IndexError):
        whole[-1]


def _task_config(**task_kwargs):
    config = common.base_config()
    config.data.task_kwargs = dict(seq_len=32, num_kv_pairs=2, vocab_size=64, **task_kwargs)
    config.data.batch_size = 4
    return config


def test_task_pipeline_is_deterministic_and_splits_differ():
    config = _task_config()
    a, b = next(data.make_iterator(config, "train")), next(data.make_iterator(config, "train"))
    e = next(data.make_iterator(config, "eval"))
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], e["inputs"])
    assert a["inputs"].shape == (4, 32) and a["loss_mask"].sum() == 4 * 2
    assert (a["segment_ids"] == 1).all()
    config.seed = 1
    assert not np.array_equal(next(data.make_iterator(config, "train"))["inputs"], a["inputs"])


def test_task_rows_pack_several_examples():
    config = _task_config()
    config.data.seq_len = 100  # three 32-token examples, 4 padding positions
    batch = next(data.make_iterator(config, "train"))
    assert batch["segment_ids"][0].tolist() == [1] * 32 + [2] * 32 + [3] * 32 + [0] * 4
    task = sources.make_task(config.data)
    seed = int(np.random.SeedSequence([0, 0, 0]).generate_state(1)[0] & 0x7FFFFFFF)  # (seed, split, block)
    ref = task.generate(seed, sources.TaskSource(task, 0, "train").block_size)
    np.testing.assert_array_equal(batch["inputs"][0, :96], ref["inputs"][:3].reshape(-1))
    np.testing.assert_array_equal(batch["loss_mask"][0, :96], ref["loss_mask"][:3].reshape(-1))


def test_tfds_builder_round_trip(tmp_path):
    kwargs = dict(seq_len=32, num_kv_pairs=2, vocab_size=64)
    build.main(["--task", "mqar", "--task_kwargs", json.dumps(kwargs), "--num_train", "40", "--num_eval", "8",
                "--data_dir", str(tmp_path)])
    import tensorflow_datasets as tfds

    source = tfds.data_source(tfds_tasks.dataset_name("mqar", kwargs), split="eval", data_dir=str(tmp_path),
                              download=False)
    assert len(source) == 8
    task = sources.make_task(_task_config().data)
    ref = task.generate(int(np.random.SeedSequence([0, 1, 0]).generate_state(1)[0] & 0x7FFFFFFF), 8)
    np.testing.assert_array_equal(np.stack([source[i]["inputs"] for i in range(8)]), ref["inputs"])
    config = _task_config()
    config.data.kind, config.data.data_dir = "tfds_task", str(tmp_path)
    batch = next(data.make_iterator(config, "train"))
    assert batch["inputs"].shape == (4, 32) and batch["loss_mask"].sum() == 8


def test_missing_datasets_raise_errors_naming_them(tmp_path):
    config = _task_config()
    config.data.kind, config.data.data_dir = "tfds_task", str(tmp_path)
    with pytest.raises(FileNotFoundError, match="synthetic_task/mqar"):
        data.make_iterator(config, "train")
    config.data.kind, config.data.tfds_name, config.data.seq_len = "tfds", "no_such_corpus", 16
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        data.make_iterator(config, "train")
    config.data.kind, config.data.files = "files", str(tmp_path / "nothing*.txt")
    with pytest.raises(FileNotFoundError, match="nothing"):
        data.make_iterator(config, "train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    config.data.files = str(bad)
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        data.make_iterator(config, "train")
    config.data.kind, config.data.files = "nope", ""
    with pytest.raises(ValueError, match="Unknown data.kind"):
        data.make_iterator(config, "train")


def test_text_files_are_tokenized_and_packed(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n\nsecond line é\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "from json"}) + "\n")
    config = common.base_config()
    config.data.kind, config.data.seq_len, config.data.batch_size = "files", 64, 1
    config.data.files = f"{tmp_path}/a.txt,{tmp_path}/b.jsonl"
    batch = next(data.make_iterator(config, "eval"))  # eval: not shuffled
    tok = ByteTokenizer()
    seg, inp = batch["segment_ids"][0], batch["inputs"][0]
    texts = [tok.decode(inp[seg == s]) for s in (1, 2, 3)]
    assert texts == ["hello world", "second line é", "from json"]
    assert data.data_vocab_size(config) == 259


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Kimi Delta Attention — état, 記憶 🙂"
    ids = tok.encode(text)
    assert ids.min() >= tok.offset and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    doc = text_to_document(tok, text)
    assert doc["inputs"][0] == tok.bos_id and doc["targets"][-1] == tok.eos_id
    np.testing.assert_array_equal(doc["inputs"][1:], doc["targets"][:-1])


def test_sentencepiece_tokenizer_round_trip(tmp_path):
    import sentencepiece as spm

    corpus = [f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=model, vocab_size=60,
                                   character_coverage=1.0, minloglevel=2)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    tok = SentencePieceTokenizer(str(path))
    assert tok.vocab_size == 60
    for text in ("the lazy fox 12", corpus[3]):
        assert tok.decode(tok.encode(text)) == text
    with pytest.raises(FileNotFoundError, match="missing.model"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "corrupt.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="corrupt.model"):
        SentencePieceTokenizer(str(tmp_path / "corrupt.model"))


def test_task_pool_is_a_fixed_set_reshuffled_every_epoch():
    """num_train_examples = N: the stream's first N examples, each exactly once per epoch, in a new
    order every epoch; hosts' shares tile it; eval stays fresh; other data kinds refuse it."""
    task = sources.make_task(_task_config().data)
    N = 20
    endless = sources.TaskSource(task, 3, "train", block_size=8)
    pooled = sources.TaskSource(task, 3, "train", block_size=8, pool=N)
    key = lambda ex: ex["inputs"].tobytes() + ex["targets"].tobytes()  # noqa: E731
    first = {key(endless[i]): i for i in range(N)}
    assert len(first) == N
    epochs = [[first[key(pooled[e * N + j])] for j in range(N)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(N))
    assert epochs[0] != epochs[1] != epochs[2]
    ex = pooled[5]
    assert ex["inputs"].dtype == np.int32 and ex["loss_mask"].dtype == bool
    np.testing.assert_array_equal(ex["loss_mask"], endless[epochs[0][5]]["loss_mask"])
    share = [sources.TaskSource(task, 3, "train", block_size=8, pool=N, shard=(h, 2)) for h in range(2)]
    assert [key(share[h][i]) for i in range(N // 2) for h in range(2)] == [key(pooled[i]) for i in range(N)]
    with pytest.raises(ValueError, match="pool"):
        sources.TaskSource(task, 3, "train", pool=-1)
    config = _task_config()
    config.data.num_train_examples = N
    train, fresh = sources.documents(config, "train"), sources.documents(config, "eval")
    assert train.pool == N and fresh.pool == 0
    config.data.kind = "files"
    with pytest.raises(ValueError, match="num_train_examples=20 takes an on-the-fly task"):
        sources.documents(config, "train")
