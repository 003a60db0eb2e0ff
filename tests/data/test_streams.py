"""Streams (`framework.data.streams`): the global order on any layout, every sample once per pass,
exact resume (again and again, on another layout, shuffled), packing, and training, evaluation
and prediction on iterable data as on map-style data. In-process: the readers of several ranks
and workers are made here side by side (the two-process runs are in test_stream_runs.py)."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
import torch

from framework import ConfigError, Engine
from framework.data.datasets import digits
from framework.data.loaders import BatchIterator
from framework.data.packing import Packer
from framework.data.stream_loader import StreamLoader
from framework.data.streams import Reader, Stream
from framework.engine.steps import forward_loss
from framework.models import MLP

TRAIN, VALID = digits()


class Iterable(torch.utils.data.IterableDataset):
    """A plain torch IterableDataset over a map-style one (no state_dict: resumed by skipping)."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def jsonl(tmp_path, n=120, name="corpus.jsonl"):
    """`n` JSON lines {"id", "text"} of varied length; a Hugging Face stream of them."""
    import datasets

    path = tmp_path / name
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"id": i, "text": " ".join(words[(i * 7 + k) % 5] for k in range(3 + i % 11))})
                + "\n"
            )
    datasets.disable_progress_bars()
    return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)


def by_slot(stream, readers, epoch=0, resume=None):
    """Every reader's items, in global-slot order."""
    got = [
        (slot, item)
        for r in range(readers)
        for item, slot, _ in Reader(stream, r, readers, epoch, resume or {})
    ]
    return [item for _, item in sorted(got, key=lambda pair: pair[0])]


def ids(loader, limit=None):
    out = []
    for batch in loader:
        out.append(batch["id"].tolist())
        if limit is not None and len(out) == limit:
            break
    return out


@pytest.mark.parametrize("window", [0, 16])
def test_the_global_order_is_the_same_on_every_layout_and_each_sample_comes_once(window):
    stream = Stream(list(range(203)), shards=8, shuffle_window=window, seed=5)
    orders = {readers: by_slot(stream, readers) for readers in (1, 2, 4, 8)}
    assert len({tuple(order) for order in orders.values()}) == 1  # one order, whatever the readers
    assert sorted(orders[1]) == list(range(203))  # every sample, once
    assert (orders[1] == list(range(203))) == (window == 0)  # shuffled only with a window
    assert by_slot(stream, 2, epoch=1) != orders[1] if window else True  # each pass its own shuffle


def test_ranks_and_workers_make_the_same_global_batches(tmp_path):
    """Global batch k of 4 on one rank is the union of the micro-batches of 2 ranks x 2 workers."""
    stream = Stream(jsonl(tmp_path), shards=8, shuffle_window=32, seed=1)
    one = ids(StreamLoader(stream, 4, 1, 0))
    two = [ids(StreamLoader(stream, 2, 2, rank, num_workers=2)) for rank in range(2)]
    assert len(one) == 30 and [sorted(a + b) for a, b in zip(*two)] == [sorted(batch) for batch in one]
    assert sorted(i for batch in one for i in batch) == list(range(120))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumes_exactly_however_often_and_on_another_layout(tmp_path, workers):
    """Three pieces of one pass, each loader made anew from the state the last one left (what a
    resume after SIGKILL does), give the uninterrupted pass; two ranks' states merged continue
    on one rank (a resume onto another data-parallel size)."""
    stream = Stream(jsonl(tmp_path), shards=8, shuffle_window=32, seed=1)
    whole = ids(StreamLoader(stream, 2, 2, 0, num_workers=workers))
    pieces, state = [], None
    for limit in (4, 7, None):
        loader = StreamLoader(stream, 2, 2, 0, num_workers=workers)
        if state is not None:
            loader.load_state_dict(state)
        pieces += ids(loader, limit)
        state = loader.state_dict()
    assert pieces == whole
    states = []
    for rank in range(2):
        loader = StreamLoader(stream, 2, 2, rank, num_workers=workers)
        ids(loader, 5)
        states.append(loader.state_dict())
    merged = {**states[0], "shards": {**states[0]["shards"], **states[1]["shards"]}}
    alone = StreamLoader(stream, 4, 1, 0)
    alone.load_state_dict(merged)
    assert ids(alone) == ids(StreamLoader(stream, 4, 1, 0))[5:]


def test_what_a_hugging_face_resume_gets_wrong_does_not_happen_here(tmp_path):
    """datasets issue 7901: a shuffled stream resumed loses about a shuffle buffer of examples and
    repeats others (the buffer is not in its state); PR 8295: a second resume restarted the stream
    from its beginning. Here: killed twice mid-pass with a shuffle window, every example comes
    exactly once and in the uninterrupted order."""
    stream = Stream(jsonl(tmp_path), shards=4, shuffle_window=50, seed=3)
    whole = [i for batch in ids(StreamLoader(stream, 3, 1, 0)) for i in batch]
    seen, state = [], None
    for limit in (5, 9, None):  # a resume, then a second one
        loader = StreamLoader(stream, 3, 1, 0)
        if state is not None:
            loader.load_state_dict(state)
        seen += [i for batch in ids(loader, limit) for i in batch]
        state = loader.state_dict()
    assert seen == whole and len(seen) == len(set(seen)) == 120


def test_a_plain_iterable_is_resumed_by_skipping_and_a_changed_order_is_refused():
    stream = Stream(Iterable(TRAIN), shards=4, shuffle_window=64)
    loader = StreamLoader(stream, 8, 1, 0)
    first = [b[1].tolist() for _, b in zip(range(3), loader)]
    again = StreamLoader(stream, 8, 1, 0)
    again.load_state_dict(loader.state_dict())
    rest = [b[1].tolist() for b in again]
    assert first + rest == [b[1].tolist() for b in StreamLoader(stream, 8, 1, 0)]
    other = StreamLoader(Stream(Iterable(TRAIN), shards=8, shuffle_window=64), 8, 1, 0)
    with pytest.raises(
        Exception, match="the checkpoint's stream was read with .* resume with the same shards"
    ):
        other.load_state_dict(loader.state_dict())


def test_shards_must_divide_ranks_times_workers():
    with pytest.raises(
        ConfigError, match=r"6 shards does not divide over 2 data-parallel rank\(s\) x 2 loader"
    ):
        StreamLoader(Stream(list(range(10)), shards=6), 1, 2, 0, num_workers=2)


def test_packing_keeps_every_token_and_resumes_inside_a_document():
    docs = [[7] * n for n in (5, 13, 2, 9)]
    packer = Packer(1, lambda d: d, block_size=8, eos_id=0)
    out = [item for i, d in enumerate(docs) for item in packer.feed(i, d)] + packer.flush()
    tokens = [t for b, _ in out for t in b["input_ids"].tolist()]
    assert tokens[: sum(len(d) + 1 for d in docs)] == [
        t for d in docs for t in (*d, 0)
    ]  # every token, EOS between
    # where each block says the next starts (document, token) is where it does
    for (_, (position, offset)), (following, _) in zip(out, out[1:]):
        again = Packer(1, lambda d: d, block_size=8, eos_id=0)
        remade = [
            item
            for i, d in enumerate(docs)
            if i >= position
            for item in again.feed(i, d, offset if i == position else 0)
        ]
        assert (remade + again.flush())[0][0]["input_ids"].tolist() == following["input_ids"].tolist()


def test_labelled_documents_keep_their_labels_in_blocks_either_way():
    """A labelled document (ids, labels), as chat data gives, is packed as it is (no EOS added)
    and its labels travel with its tokens; kept apart, each document's first label is -100."""
    docs = [([1, 2, 3, 4, 5], [-100, -100, 3, 4, 5]), ([], []), ([6, 7, 8], [-100, 7, 8]), ([9, 10], [9, 10])]
    for keep_apart in (False, True):
        packer = Packer(1, lambda d: d, block_size=4, eos_id=0, keep_apart=keep_apart)
        out = [b for i, d in enumerate(docs) for b, _ in packer.feed(i, d)] + [b for b, _ in packer.flush()]
        ids = [t for b in out for t in b["input_ids"].tolist() if t]
        labels = [label for b in out for label in b["labels"].tolist()]
        assert ids == [t for d, _ in docs for t in d]  # every token once, no EOS between
        if keep_apart:  # [1 2 3 4] [5 | 6 7 8] [9 10 pad pad]: a piece starts a document
            assert labels == [-100, -100, 3, 4, -100, -100, 7, 8, -100, 10, -100, -100]
        else:
            assert labels[:10] == [label for _, marks in docs for label in marks]


def test_documents_kept_apart_give_the_loss_of_one_document_per_row():
    """Packed with position ids restarting per document (no attention across documents), a
    Hugging Face Llama's per-token loss over a block equals its loss over the same documents one
    per row (fp32), also through the framework's training step (the model in training mode, its
    configured key/value cache on: a cache would hide the packing from the attention)."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    assert model.config.use_cache
    docs = [torch.randint(1, 64, (n,)).tolist() for n in (6, 10, 4, 7)]
    packer = Packer(1, lambda d: d, block_size=32, eos_id=63, keep_apart=True)
    blocks = [item for i, d in enumerate(docs) for item in packer.feed(i, d)] + packer.flush()
    batch = {
        k: torch.stack([torch.from_numpy(b[k]) for b, _ in blocks])
        for k in ("input_ids", "labels", "position_ids")
    }
    with torch.no_grad():
        step = SimpleNamespace(model=model, module=model, label_key="labels", loss="model")
        packed = forward_loss(step, batch)[2]
        rows = [torch.tensor([[*d, 63]]) for d in docs]
        per_row = sum(model(input_ids=r, labels=r).loss * (r.shape[1] - 1) for r in rows) / sum(
            len(d) for d in docs
        )
    assert len(blocks) == 1 and abs(float(packed) - float(per_row)) < 1e-5


def engine(**kw):
    torch.manual_seed(0)
    return Engine(MLP(), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), **kw)


def test_fit_on_a_stream_trains_what_fit_on_the_same_map_style_data_trains():
    """Unshuffled, a stream's global batches are the dataset's own: the same weights, bit for bit."""
    mapped = engine()
    mapped.fit(TRAIN, epochs=1, batch_size=64, shuffle=False, max_steps=12, progress=False)
    streamed = engine()
    streamed.fit(Iterable(TRAIN), epochs=1, batch_size=64, shuffle=False, max_steps=12, progress=False)
    assert streamed.state.global_step == 12 and streamed.state.batches_fetched == 12
    for a, b in zip(mapped.module.parameters(), streamed.module.parameters()):
        assert torch.equal(a, b)
    assert streamed.evaluate(Iterable(VALID), batch_size=64) == streamed.evaluate(VALID, batch_size=64)
    predicted = torch.cat(streamed.predict(Iterable(VALID), batch_size=64))
    assert torch.equal(predicted, torch.cat(streamed.predict(VALID, batch_size=64)))


def test_fit_rejects_unsized_data():
    """The peers' test, on ours: a stream trains under max_steps (and a finite one's epochs end at
    its end); without a step budget it is one line naming trainer.max_steps."""
    with pytest.raises(
        ConfigError, match=r"the training data is a stream .* max_steps \(trainer.max_steps=N"
    ):
        engine().fit(Iterable(TRAIN), batch_size=64, progress=False)
    run = engine()
    history = run.fit(Iterable(TRAIN), epochs=2, batch_size=64, max_steps=10**6, progress=False)
    assert run.state.global_step == 2 * (len(TRAIN) // 64) and len(history["loss"]) == 2


@pytest.mark.parametrize("option", ["steps_per_epoch", "max_steps", "valid_steps", "epochs"])
def test_a_step_count_that_is_not_positive_is_one_line(option):
    with pytest.raises(ConfigError, match=rf"fit\({option}=0\): {option} must be a whole number >= 1"):
        engine().fit(TRAIN, batch_size=64, progress=False, **{option: 0})


def test_done_dataloader_iter_unsized():
    """The peers' test, on ours: over unsized data a dataloader_iter knows it is done one batch
    ahead, without a StopIteration (the step is never called on an empty epoch)."""
    batches = BatchIterator(iter(StreamLoader(Stream(list(range(6)), shards=1), 2, 1, 0)))
    assert not batches.exhausted()
    assert [next(batches).tolist() for _ in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert batches.exhausted() and batches.fetched == 3

    def two_at_a_time(host, dataloader_iter):
        x1, y1 = next(dataloader_iter)
        x2, y2 = next(dataloader_iter)
        return (host.loss(host.model(x1), y1) + host.loss(host.model(x2), y2)) / 2

    run = engine(train_step=two_at_a_time)
    run.fit(Iterable(TRAIN), epochs=1, batch_size=64, max_steps=10**6, progress=False)
    assert (
        run.state.batches_fetched == len(TRAIN) // 64 // 2 * 2
        and run.state.global_step == len(TRAIN) // 64 // 2
    )


# ------------------------------------------------------------------ issue 42: what a stream refuses


def uneven_jsonl(path, docs=40, long_words=400):
    """Documents alternating ~2 KB and a few bytes: with 2 shards, one shard packs ~600 times the
    blocks of the other."""
    with open(path, "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": "word " * long_words if i % 2 == 0 else "hi"}) + "\n")
    return path


def test_an_hf_stream_pickles_for_spawned_loader_workers(tmp_path):
    """A `trainer.devices=N` job's loader workers are spawned, and get the stream by pickling: its
    packer and tokenizer are module-level callables, and the copy reads the same blocks."""
    import pickle

    from framework.data.datasets.hf import hf_stream

    splits = hf_stream(str(uneven_jsonl(tmp_path / "c.jsonl")), builder="json", block_size=32, shards=2)
    copy = pickle.loads(pickle.dumps(splits.train))
    first = [b["input_ids"].tolist() for b in StreamLoader(splits.train, 2, 1, 0)]
    assert first and first == [b["input_ids"].tolist() for b in StreamLoader(copy, 2, 1, 0)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 0}, r"data.dataset.block_size=0: must be a whole number >= 1"),
        ({"block_size": 2.5}, r"data.dataset.block_size=2.5: must be a whole number >= 1"),
        ({"shards": 0}, r"data.dataset.shards=0: must be a whole number >= 1"),
        ({"seed": -1}, r"data.dataset.seed=-1: must be a whole number >= 0"),
        ({"val_every": 0}, r"data.dataset.val_every=0: must be a whole number >= 2"),
        ({"val_every": 1}, r"data.dataset.val_every=1: must be a whole number >= 2"),
        ({"builder": "jsn"}, r"data.dataset.builder=jsn: use one of text, json, parquet, csv"),
    ],
)
def test_every_number_an_hf_stream_takes_is_checked_where_it_is_read(tmp_path, options, message):
    """block_size=0 looped forever in the packer (memory running away); val_every=0 was a
    ZeroDivisionError deep in a reader. Each is one line naming the key, before anything is read."""
    from framework.data.datasets.hf import hf_stream

    kwargs = {"builder": "json", **options}
    with pytest.raises(ConfigError, match=rf"^{message}"):
        hf_stream(str(uneven_jsonl(tmp_path / "c.jsonl")), **kwargs)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Packer(1, list, block_size=0, eos_id=0),
            r"packed\(block_size=0\): must be a whole number >= 1",
        ),
        (
            lambda: Packer(1, list, block_size=8, eos_id=-1),
            r"packed\(eos_id=-1\): must be a whole number >= 0",
        ),
        (lambda: Stream([1, 2], shards=2.5), r"Stream\(shards=2.5\): must be a whole number >= 1"),
        (lambda: Stream([1, 2], shuffle_window=-3), r"Stream\(shuffle_window=-3\): must be"),
        (lambda: StreamLoader(Stream([1, 2], shards=1), 0, 1, 0), r"micro_batch_size=0: must be"),
        (lambda: StreamLoader(Stream([1, 2], shards=1), 1, 1, 0, -1), r"num_workers=-1 \(data.num_workers\)"),
    ],
)
def test_a_packer_stream_and_loader_refuse_numbers_that_cannot_work(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize("value", [0, 1, 1.5, "a"])
def test_hf_text_refuses_a_validation_fraction_outside_0_1(tmp_path, value):
    from framework.data.datasets.hf import hf_text

    path = tmp_path / "t.txt"
    path.write_text("some text\n" * 50)
    with pytest.raises(
        ConfigError, match=rf"data.dataset.val_fraction={value!r}: must be a number between 0 and 1"
    ):
        hf_text(str(path), val_fraction=value)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_malformed_json_line_is_one_line_naming_file_and_line(tmp_path, workers):
    """A JSONL file with one broken line was 124 lines of pandas/pyarrow tracebacks (also from a
    loader worker, which hands its traceback on inside the message)."""
    from framework.data.datasets.hf import hf_stream

    good, bad = uneven_jsonl(tmp_path / "good.jsonl"), tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"document {i}"}) for i in range(60)]
    lines[50] = '{"text": "cut off'
    bad.write_text("\n".join(lines) + "\n")
    splits = hf_stream([str(good), str(bad)], builder="json", block_size=16, shards=2)
    with pytest.raises(ConfigError) as caught:
        list(StreamLoader(splits.train, 2, 1, 0, num_workers=workers))
    text = str(caught.value)
    assert text.startswith(f"{bad}: line 51 cannot be read (") and len(text.splitlines()) == 1, text


class Uneven:
    """A shard transform whose even source positions give 8 items and odd ones 1: with 2 shards,
    shard 0 holds 8 times the items of shard 1."""

    def __init__(self, shards):
        self.shards = shards

    def feed(self, position, example, offset=0):
        return [(example, (position + self.shards, 0))] * (8 if position % 2 == 0 else 1)

    def flush(self):
        return []


def test_a_pass_that_leaves_data_untrained_says_how_much(capsys):
    """A pass ends at its first empty global slot: shards of very different lengths end it at the
    shortest one's end (1 optimizer step of ~400 in the issue, without a word). It says how many
    source examples it left, on one line; an even stream says nothing."""
    data = Iterable([TRAIN[i] for i in range(640)])
    run = engine()
    run.fit(Stream(data, Uneven, shards=2), batch_size=64, max_steps=10**6, progress=False)
    # slot 2p is shard 0's item p, 2p + 1 shard 1's: the pass ends after shard 1's 320 items,
    # having used 320 / 8 = 40 of shard 0's 320 examples: 280 of 640 left (44 %)
    assert run.state.global_step == 640 // 64
    err = capsys.readouterr().err
    assert "warning: this pass ended at its shortest shard's end and left 280 of 640 examples (44 %)" in err
    even = engine()
    even.fit(Stream(data, shards=2), batch_size=64, max_steps=10**6, progress=False)
    assert even.state.global_step == 10 and "warning" not in capsys.readouterr().err


class Blocks:
    """A shard transform that makes 8 items of each example (a long document packed into 8 blocks)."""

    def __init__(self, shards):
        self.shards = shards

    def feed(self, position, example, offset=0):
        return [(example, (position + self.shards, 0))] * 8

    def flush(self):
        return []


def test_an_evaluation_pass_reads_every_shard_of_its_rank_to_the_end():
    """10 documents of 8 blocks each in 64 shards (hf_stream's validation of a 200-document file):
    a pass that ends at its first empty slot evaluated 10 of the 80 blocks, silently. Read to the
    end, every block counts once, on 1 and 2 ranks, with loader workers too; a rank whose share is
    empty (one document, all in shard 0) pads with a sample of the stream instead of refusing."""
    stream = Stream([{"id": i} for i in range(10)], Blocks, shards=64)

    def evaluated(ranks, workers=0, to_the_end=True):
        return sorted(
            i
            for rank in range(ranks)
            for batch in StreamLoader(stream, 4, ranks, rank, workers, False, to_the_end=to_the_end)
            for i in batch["id"].tolist()
        )

    assert evaluated(2, to_the_end=False) == list(range(10))  # training's pass: to the first empty slot
    every = sorted(list(range(10)) * 8)
    assert evaluated(1) == evaluated(2) == evaluated(2, workers=2) == every
    one = Stream([{"id": 5}], Blocks, shards=64)
    empty = StreamLoader(one, 4, 2, 1, drop_last=False, to_the_end=True)
    assert list(empty) == [] and empty.padding_batch()["id"].tolist() == [5]


@pytest.mark.parametrize("samples", [0, 40])
def test_a_run_that_trains_no_step_fails_and_saves_nothing(tmp_path, samples):
    """An empty stream, or one shorter than one global batch, reported success: rc 0, a final
    loss of 0.0 (a sweep ranked it best) and a step-0 checkpoint. It is one line now, and no
    checkpoint is written."""
    data = Iterable([TRAIN[i] for i in range(samples)])
    with pytest.raises(ConfigError, match=r"^no optimizer step was trained: the training stream ran out"):
        engine().fit(data, batch_size=64, max_steps=100, save_dir=str(tmp_path), progress=False)
    assert not list(tmp_path.glob("step_*"))
