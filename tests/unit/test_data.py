"""Corpora, tokenizers and the distributed batch loader."""

from __future__ import annotations

import json
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from loomtrain.config import ConfigError, DataConfig
from loomtrain.data import (
    BPETokenizer,
    CharTokenizer,
    DistributedBatchLoader,
    build_tokenizer,
    check_data_files,
    encode_to_tensor,
    eval_batches,
    load_corpus,
    load_tokenizer,
    shakespeare_plays,
)

# ---------------------------------------------------------------- corpus


def test_all_38_plays_found_and_markdown_stripped():
    """Catches: a genre folder or play missed by the resource walk, slugs out of order (the
    train/val join order would change), or markdown left in the text (``**NAME**``, ``_stage_``,
    ``#`` headings, ``\\[`` escapes, two-space line breaks, runs of blank lines) that would become tokens."""
    plays = shakespeare_plays()
    assert len(plays) == 38
    assert list(plays) == sorted(plays)
    text = "".join(plays.values())
    for markup in ("**", "_", "#", "\\["):
        assert markup not in text
    romeo = plays["romeo-and-juliet"]
    assert romeo.startswith("Romeo and Juliet\n\nACT I\n")
    assert "\nSAMPSON:\nGregory, o' my word, we'll not carry coals.\n\nGREGORY:\n" in romeo
    assert "SCENE I. Verona. A public place." in romeo
    assert "  \n" not in text and "\n\n\n" not in text


def test_parsed_plays_cache_is_rebuilt_when_torn_and_keyed_by_text_and_parser(tmp_path, monkeypatch):
    """Catches: a torn or corrupt cache file that crashes every start (or is served as the
    corpus), a cache not written (every start parses again), and a key blind to the plays' text
    or to the parser (a changed parser would keep training on the old text)."""
    from loomtrain.data import corpus

    monkeypatch.setenv("LOOMTRAIN_CACHE_DIR", str(tmp_path))
    parse = corpus._parsed_plays.__wrapped__  # skip the per-process memo
    fresh = parse()
    (cached,) = tmp_path.glob("shakespeare-*.json")
    assert parse() == fresh
    cached.write_text('[["hamlet", "torn')
    assert parse() == fresh and json.loads(cached.read_text()) == [list(p) for p in fresh]
    raw = [(slug, f.read_text(encoding="utf-8")) for slug, f in corpus._play_files().items()]
    key = corpus._parse_key(raw)
    assert corpus._parse_key([*raw[:-1], (raw[-1][0], raw[-1][1] + "x")]) != key
    monkeypatch.setattr(corpus, "_EMPHASIS", re.compile(r"[*]"))
    assert corpus._parse_key(raw) != key


def test_val_plays_are_held_out_whole_not_leaked_into_train():
    """Catches: a validation play also trained on (or only partly held out), or a training play
    put into the validation split."""
    plays = shakespeare_plays()
    train, val = load_corpus(DataConfig(val_plays=["hamlet", "the-tempest"]))
    assert plays["hamlet"].strip() in val and plays["the-tempest"].strip() in val
    assert plays["hamlet"][:2000] not in train
    assert plays["macbeth"].strip() in train and plays["macbeth"][:2000] not in val


def test_unknown_val_play_error_names_field_and_lists_slugs():
    """Catches: a misspelt ``data.val_plays`` entry silently ignored (validation on fewer plays
    than asked), or an error that names neither the field nor the valid slugs, in
    ``load_corpus`` or in the launcher's ``check_data_files``."""
    with pytest.raises(ConfigError, match=r"data\.val_plays.*'hamlett'.*romeo-and-juliet"):
        load_corpus(DataConfig(val_plays=["hamlett"]))
    with pytest.raises(ConfigError, match=r"data\.val_plays"):
        check_data_files(DataConfig(val_plays=["nope"]))


def test_every_play_in_validation_is_rejected():
    """Catches: ``data.val_plays`` listing every play accepted, leaving an empty training text."""
    with pytest.raises(ConfigError, match="nothing to train"):
        load_corpus(DataConfig(val_plays=list(shakespeare_plays())))


def _files_cfg(*paths, **kw) -> DataConfig:
    return DataConfig(dataset="files", paths=[str(p) for p in paths], **kw)


def test_txt_jsonl_parquet_readers_join_documents(tmp_path):
    """Catches: a reader that drops, reorders or mis-decodes documents (non-ASCII, blank JSONL
    lines, Parquet nulls), documents not joined by one blank line, or ``data.val_paths`` ignored."""
    (tmp_path / "a.txt").write_text("first doc\n", encoding="utf-8")
    with (tmp_path / "b.jsonl").open("w") as f:
        f.write(json.dumps({"body": "second"}) + "\n\n" + json.dumps({"body": "thïrd"}) + "\n")
    pq.write_table(pa.table({"body": ["fourth", None, "fifth"]}), tmp_path / "c.parquet")
    cfg = _files_cfg(tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet", text_field="body")
    check_data_files(cfg)
    train, val = load_corpus(cfg.model_copy(update={"val_paths": [str(tmp_path / "a.txt")]}))
    assert train == "first doc\n\nsecond\n\nthïrd\n\nfourth\n\nfifth"
    assert val == "first doc"


def test_val_fraction_splits_tail_of_training_text(tmp_path):
    """Catches: ``data.val_fraction`` taking the head instead of the tail, or a wrongly sized cut."""
    (tmp_path / "a.txt").write_text("x" * 90 + "y" * 10)
    train, val = load_corpus(_files_cfg(tmp_path / "a.txt", val_fraction=0.1))
    assert (train, val) == ("x" * 90, "y" * 10)


def test_missing_file_fails_before_launch_naming_field(tmp_path):
    """Catches: a missing file in ``data.paths`` or ``data.val_paths`` passing the launcher's
    check (it would fail later inside every rank), or an error naming the wrong field."""
    with pytest.raises(ConfigError, match=r"data\.paths: file '.*nope\.txt' does not exist"):
        check_data_files(_files_cfg(tmp_path / "nope.txt"))
    (tmp_path / "a.txt").write_text("text")
    cfg = _files_cfg(tmp_path / "a.txt", val_paths=[str(tmp_path / "v.txt")])
    with pytest.raises(ConfigError, match=r"data\.val_paths: file '.*v\.txt' does not exist"):
        check_data_files(cfg)


def test_empty_or_blank_file_rejected(tmp_path):
    """Catches: an empty ``.txt`` or a ``.jsonl`` of whitespace-only text accepted as data."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": "  \n"}) + "\n")
    for name in ("empty.txt", "blank.jsonl"):
        with pytest.raises(ConfigError, match=rf"data\.paths: file '.*{name}'"):
            check_data_files(_files_cfg(tmp_path / name))


def test_jsonl_line_without_text_field_names_field_file_and_line(tmp_path):
    """Catches: a JSONL record without ``data.text_field`` skipped silently or reported without
    its file and line number."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"data\.text_field: file '.*d\.jsonl' line 2"):
        load_corpus(_files_cfg(path))


def test_parquet_without_text_column_names_field(tmp_path):
    """Catches: a Parquet file lacking the ``data.text_field`` column failing with a raw pyarrow
    error instead of naming the field."""
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["x"]}), path)
    with pytest.raises(ConfigError, match=r"data\.text_field: file '.*d\.parquet'"):
        check_data_files(_files_cfg(path))


def test_unknown_suffix_names_data_paths(tmp_path):
    """Catches: a file of an unsupported type read as text, or rejected without naming the suffix."""
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(ConfigError, match=r"data\.paths: file '.*d\.csv' has suffix '\.csv'"):
        check_data_files(_files_cfg(tmp_path / "d.csv"))


# ---------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trips_and_survives_save_load(tmp_path):
    """Catches: a vocabulary that is not the sorted distinct characters, non-int64 ids,
    ``encode`` and ``encode_to_tensor`` disagreeing, ``decode`` not inverting ``encode``, or a
    save/load that loses or reorders characters (the non-ASCII '—' included)."""
    text = "ROMEO:\nBut soft, what light — through yonder window breaks?\n"
    tok = build_tokenizer("char", text, bpe_vocab_size=256)
    assert isinstance(tok, CharTokenizer) and tok.kind == "char"
    assert tok.vocab_size == len(set(text)) and tok.chars == sorted(set(text))
    ids = encode_to_tensor(tok, text)
    assert ids.dtype == torch.int64 and ids.shape == (len(text),)
    assert ids.tolist() == tok.encode(text)
    assert tok.decode(ids) == text
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.kind == "char" and loaded.encode(text) == tok.encode(text)


def test_char_tokenizer_unknown_char_raises_naming_it():
    """Catches: an unknown character encoded silently as some id instead of raising, whether its
    code point lies below the vocabulary's largest ('c', 'z': a lookup table not filled with -1)
    or above it (U+1F680: clipped onto the table's last entry, which must stay -1), or an error
    naming another character than the first unknown one (a position counted in UTF-16 units or
    bytes would be shifted by the astral U+1F642 before 'z')."""
    tok = CharTokenizer.from_text("abd\U0001f642")
    with pytest.raises(ValueError, match="'c'"):
        tok.encode("abcd")
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("a\U0001f642bz")
    with pytest.raises(ValueError, match="U\\+1F680"):
        encode_to_tensor(tok, "a\U0001f680")


class _NoPerCharAccess(str):
    """Text whose characters cannot be visited one at a time, not even by a loop in C
    (``map(f, text)``, ``list(text)``) that line tracing cannot see."""

    def __iter__(self):
        raise AssertionError("the text was iterated character by character")

    def __getitem__(self, index):
        raise AssertionError("the text was indexed character by character")


def _with_python_lines(fn, *args, limit: int = 10_000):
    """``(fn(*args), number of Python lines it ran)``; numpy's and torch's C loops run none.

    Past ``limit`` lines the call is stopped, so that a per-character loop over megabytes fails
    at once instead of being traced for minutes."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > limit:
                raise AssertionError(f"more than {limit} Python lines run: a loop per character")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn(*args), count
    finally:
        sys.settrace(previous)


def test_char_encoding_of_5mb_is_vectorised_not_a_python_loop():
    """Catches: ``encode_tensor`` turned into a loop per character (nanoGPT's ``[stoi[c] for c in
    s]``, ``map(stoi.get, s)``), which costs seconds per rank on a 5 MB corpus at every start,
    and ids shifted after the corpus's non-ASCII '—' (a UTF-8 byte view instead of code points).
    The work is counted, not timed: the Python lines run must not grow with the text, and the
    text's characters must not be visited one by one. Speed: ``benchmarks/bench_data.py``."""
    text = "".join(shakespeare_plays().values())
    tok = CharTokenizer.from_text(text)
    tok.encode_tensor(text[:100])  # the first call imports Python's utf-32 codec: lines not run again
    _, lines_short = _with_python_lines(tok.encode_tensor, _NoPerCharAccess(text[:100]))
    ids, lines_long = _with_python_lines(tok.encode_tensor, _NoPerCharAccess(text))
    assert lines_long == lines_short
    assert ids.shape == (len(text),)
    probes = [*range(0, len(text), 997), text.index("—") + 1, len(text) - 1]
    assert [int(ids[i]) for i in probes] == [tok.chars.index(text[i]) for i in probes]


def test_bpe_trains_saves_loads_and_round_trips_any_text(tmp_path):
    """Catches: a BPE that learns no merges or the wrong vocabulary size, does not round-trip
    unseen bytes and whitespace, or encodes differently after save/load (or in ``encode`` than in
    ``encode_to_tensor``)."""
    text = shakespeare_plays()["macbeth"][:30_000]
    tok = build_tokenizer("bpe", text, bpe_vocab_size=300)
    assert isinstance(tok, BPETokenizer) and tok.kind == "bpe" and tok.vocab_size == 300
    ids = encode_to_tensor(tok, text)
    assert ids.dtype == torch.int64 and len(ids) < len(text)
    assert tok.decode(ids) == text
    unseen = "naïve café 😀\n\n  tabs\tand  spaces  \n"
    assert tok.decode(tok.encode(unseen)) == unseen
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = load_tokenizer(tmp_path)
    assert loaded.kind == "bpe" and loaded.vocab_size == 300
    assert loaded.encode(text) == ids.tolist()


def test_unknown_tokenizer_kind_names_config_field():
    """Catches: an unknown ``data.tokenizer`` falling back to some tokenizer, or an error without
    the field's name."""
    with pytest.raises(ConfigError, match=r"data\.tokenizer"):
        build_tokenizer("word", "abc", 256)


def test_load_tokenizer_from_empty_dir_says_what_is_missing(tmp_path):
    """Catches: ``generate`` or a resume on a run without a saved tokenizer failing with an
    unexplained error instead of naming the missing file."""
    with pytest.raises(FileNotFoundError, match="tokenizer_meta.json"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- loader

SEQ = 8
TOKENS = torch.arange(50 * SEQ + 1)  # 50 windows; token value = its position, so windows are readable


def _loaders(dp_size: int, gbs: int = 16, mb: int = 2, seed: int = 0, tokens=TOKENS):
    return [DistributedBatchLoader(tokens, SEQ, gbs, mb, r, dp_size, seed) for r in range(dp_size)]


def _step_windows(loaders) -> list[list[int]]:
    """Per rank: the window ids of one step, flattened over micro-batches."""
    out = []
    for loader in loaders:
        loader.next_step()
        out.append([w for mb in loader.last_sample_ids for w in mb])
    return out


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_disjoint_and_union_equals_single_rank_global_batch(dp_size):
    """Catches: ranks that share or skip samples within a step, or a global batch that depends
    on the data-parallel size (the loss curve would change with the world size), also across
    epoch boundaries."""
    single = _loaders(1)[0]
    ranks = _loaders(dp_size)
    for step in range(7):  # 7 * 16 = 112 samples over 50 windows: crosses two epoch boundaries
        (expected,) = _step_windows([single])
        flat = [w for r in _step_windows(ranks) for w in r]
        assert sorted(flat) == sorted(expected) and len(flat) == 16
        if step * 16 // 50 == (step * 16 + 15) // 50:  # a straddling step may hold a window twice
            assert len(set(flat)) == 16


def test_micro_batch_layout_interleaves_ranks_by_accumulation_step():
    """Catches: a micro-batch layout other than the documented interleaving (rank ``r``'s
    micro-batch ``a`` at positions ``(a*dp + r)*mb``), on which resuming at another dp size relies."""
    single = _loaders(1, gbs=16, mb=2)[0]
    single.next_step()
    order = [w for mb in single.last_sample_ids for w in mb]
    ranks = _loaders(2, gbs=16, mb=2)
    for r, loader in enumerate(ranks):
        loader.next_step()
        assert len(loader.last_sample_ids) == 4
        for a, ids in enumerate(loader.last_sample_ids):
            start = (a * 2 + r) * 2
            assert ids == order[start : start + 2]


def test_y_is_x_shifted_by_one_and_matches_window_ids():
    """Catches: targets not shifted by exactly one token, wrong window offsets, or
    ``last_sample_ids`` (the sample audit) not matching the tokens actually served."""
    loader = _loaders(2, gbs=8, mb=2)[1]
    batches = loader.next_step()
    assert len(batches) == 2
    for (x, y), ids in zip(batches, loader.last_sample_ids, strict=True):
        assert x.shape == y.shape == (2, SEQ) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        for row, w in zip(x, ids, strict=True):
            assert row.tolist() == list(range(w * SEQ, w * SEQ + SEQ))


def test_same_seed_same_batches_other_seed_differs():
    """Catches: an order drawn from the global RNG or ignoring the seed (runs would not be
    reproducible, or every seed would see the same order)."""
    a, b, c = _loaders(1, seed=3)[0], _loaders(1, seed=3)[0], _loaders(1, seed=4)[0]
    ids_a, ids_b, ids_c = ([_step_windows([loader]) for _ in range(3)] for loader in (a, b, c))
    assert ids_a == ids_b and ids_a != ids_c


def test_resume_from_state_dict_gives_identical_next_batches():
    """Catches: a resume that loses the position or the seed, keeps a permutation cached under
    the old seed, or checkpoints non-int state."""
    run = _loaders(2)[0]
    for _ in range(3):
        run.next_step()
    state = run.state_dict()
    assert all(type(v) is int for v in state.values())
    resumed = _loaders(2, seed=99)[0]
    resumed.next_step()  # a loader that already ran with another seed must not keep its old order
    resumed.load_state_dict(state)
    for _ in range(4):
        expected, got = run.next_step(), resumed.next_step()
        for (xe, ye), (xg, yg) in zip(expected, got, strict=True):
            assert torch.equal(xe, xg) and torch.equal(ye, yg)


def test_resume_at_other_dp_size_keeps_global_sample_set_per_step():
    """Catches: a data position kept per rank rather than globally, so that an elastic resume
    at another world size would skip or repeat samples."""
    before = _loaders(4, gbs=16, mb=2)
    for _ in range(2):
        _step_windows(before)
    reference = _loaders(4, gbs=16, mb=2)
    for loader in reference:
        loader.load_state_dict(before[0].state_dict())
    after = _loaders(2, gbs=16, mb=4)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    for _ in range(4):
        want = sorted(w for r in _step_windows(reference) for w in r)
        got = sorted(w for r in _step_windows(after) for w in r)
        assert got == want


def test_epochs_straddled_without_skipping_or_repeating_windows():
    """Catches: windows skipped or repeated where a step straddles an epoch end, or the same
    permutation reused every epoch."""
    loader = _loaders(1, gbs=12, mb=4)[0]  # 50 windows, 12 per step: steps straddle epoch ends
    seen = []
    for _ in range(25):  # 300 samples = exactly 6 epochs
        seen.extend(w for r in _step_windows([loader]) for w in r)
    epochs = [seen[i * 50 : (i + 1) * 50] for i in range(6)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))
    assert epochs[0] != epochs[1]


def test_load_state_dict_rejects_other_seq_len_or_corpus():
    """Catches: a checkpoint from another corpus or ``seq_len`` resumed silently, at a position
    that means other samples."""
    state = _loaders(1)[0].state_dict()
    other = DistributedBatchLoader(torch.arange(30 * SEQ + 1), SEQ, 16, 2, 0, 1, 0)
    with pytest.raises(ValueError, match="n_windows"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        DistributedBatchLoader(TOKENS, SEQ // 2, 16, 2, 0, 1, 0).load_state_dict(state)


def test_bad_batch_layout_or_tiny_data_rejected():
    """Catches: a global batch that the ranks' micro-batches do not divide (samples dropped), or
    a corpus shorter than one window, accepted instead of refused with the field's name."""
    with pytest.raises(ValueError, match=r"training\.global_batch_size"):
        DistributedBatchLoader(TOKENS, SEQ, 12, 4, 0, 2, 0)
    with pytest.raises(ValueError, match="window"):
        DistributedBatchLoader(torch.arange(SEQ), SEQ, 2, 1, 0, 1, 0)


def test_eval_batches_are_fixed_spread_and_aligned():
    """Catches: validation batches that change between calls (val losses not comparable), that
    repeat a window, that cover only the head of the validation set, or with misaligned targets."""
    batches = eval_batches(TOKENS, SEQ, 2, 12)
    assert len(batches) == 12 and all(x.shape == (2, SEQ) for x, _ in batches)
    starts = [int(x[i, 0]) // SEQ for x, _ in batches for i in range(2)]
    assert len(starts) == len(set(starts)) == 24
    assert max(starts) - min(starts) > 40  # spread over the whole validation set, not its head
    for (x1, y1), (x2, y2) in zip(batches, eval_batches(TOKENS, SEQ, 2, 12), strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(y1[:, :-1], x1[:, 1:])


def test_eval_batches_wrap_when_validation_is_small():
    """Catches: reading past the last validation window (a crash or a short window) or using only
    part of a small validation set, instead of cycling through all of its windows in order."""
    tokens = torch.arange(3 * SEQ + 1)  # 3 windows for 4 batches × 2 samples = 8 slots
    batches = eval_batches(tokens, SEQ, 2, 4)
    assert [(x[:, 0] // SEQ).tolist() for x, _ in batches] == [[0, 1], [2, 0], [1, 2], [0, 1]]
    assert all(x.shape == (2, SEQ) and torch.equal(y[:, :-1], x[:, 1:]) for x, y in batches)
