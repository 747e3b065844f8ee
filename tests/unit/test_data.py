"""Corpora, tokenizers and the distributed batch loader."""

from __future__ import annotations

import json
import time

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


def test_val_plays_are_held_out_whole_not_leaked_into_train():
    plays = shakespeare_plays()
    train, val = load_corpus(DataConfig(val_plays=["hamlet", "the-tempest"]))
    assert plays["hamlet"].strip() in val and plays["the-tempest"].strip() in val
    assert plays["hamlet"][:2000] not in train
    assert plays["macbeth"].strip() in train and plays["macbeth"][:2000] not in val


def test_unknown_val_play_error_names_field_and_lists_slugs():
    with pytest.raises(ConfigError, match=r"data\.val_plays.*'hamlett'.*romeo-and-juliet"):
        load_corpus(DataConfig(val_plays=["hamlett"]))
    with pytest.raises(ConfigError, match=r"data\.val_plays"):
        check_data_files(DataConfig(val_plays=["nope"]))


def test_every_play_in_validation_is_rejected():
    with pytest.raises(ConfigError, match="nothing to train"):
        load_corpus(DataConfig(val_plays=list(shakespeare_plays())))


def _files_cfg(*paths, **kw) -> DataConfig:
    return DataConfig(dataset="files", paths=[str(p) for p in paths], **kw)


def test_txt_jsonl_parquet_readers_join_documents(tmp_path):
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
    (tmp_path / "a.txt").write_text("x" * 90 + "y" * 10)
    train, val = load_corpus(_files_cfg(tmp_path / "a.txt", val_fraction=0.1))
    assert (train, val) == ("x" * 90, "y" * 10)


def test_missing_file_fails_before_launch_naming_field(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.paths: file '.*nope\.txt' does not exist"):
        check_data_files(_files_cfg(tmp_path / "nope.txt"))
    (tmp_path / "a.txt").write_text("text")
    cfg = _files_cfg(tmp_path / "a.txt", val_paths=[str(tmp_path / "v.txt")])
    with pytest.raises(ConfigError, match=r"data\.val_paths: file '.*v\.txt' does not exist"):
        check_data_files(cfg)


def test_empty_or_blank_file_rejected(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": "  \n"}) + "\n")
    for name in ("empty.txt", "blank.jsonl"):
        with pytest.raises(ConfigError, match=rf"data\.paths: file '.*{name}'"):
            check_data_files(_files_cfg(tmp_path / name))


def test_jsonl_line_without_text_field_names_field_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"data\.text_field: file '.*d\.jsonl' line 2"):
        load_corpus(_files_cfg(path))


def test_parquet_without_text_column_names_field(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["x"]}), path)
    with pytest.raises(ConfigError, match=r"data\.text_field: file '.*d\.parquet'"):
        check_data_files(_files_cfg(path))


def test_unknown_suffix_names_data_paths(tmp_path):
    (tmp_path / "d.csv").write_text("a,b")
    with pytest.raises(ConfigError, match=r"data\.paths: file '.*d\.csv' has suffix '\.csv'"):
        check_data_files(_files_cfg(tmp_path / "d.csv"))


# ---------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trips_and_survives_save_load(tmp_path):
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
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("abz")
    with pytest.raises(ValueError, match="U\\+1F600"):
        encode_to_tensor(tok, "a\U0001f600")


def test_char_encoding_of_5mb_is_vectorised_not_a_python_loop():
    text = "".join(shakespeare_plays().values())[:5_000_000]
    tok = CharTokenizer.from_text(text)
    start = time.perf_counter()
    ids = encode_to_tensor(tok, text)
    assert time.perf_counter() - start < 1.5
    assert ids[:100].tolist() == [tok.chars.index(c) for c in text[:100]]


def test_bpe_trains_saves_loads_and_round_trips_any_text(tmp_path):
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
    with pytest.raises(ConfigError, match=r"data\.tokenizer"):
        build_tokenizer("word", "abc", 256)


def test_load_tokenizer_from_empty_dir_says_what_is_missing(tmp_path):
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
    single = _loaders(1)[0]
    ranks = _loaders(dp_size)
    for step in range(7):  # 7 * 16 = 112 samples over 50 windows: crosses two epoch boundaries
        (expected,) = _step_windows([single])
        flat = [w for r in _step_windows(ranks) for w in r]
        assert sorted(flat) == sorted(expected) and len(flat) == 16
        if step * 16 // 50 == (step * 16 + 15) // 50:  # a straddling step may hold a window twice
            assert len(set(flat)) == 16


def test_micro_batch_layout_interleaves_ranks_by_accumulation_step():
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
    loader = _loaders(2, gbs=8, mb=2)[1]
    batches = loader.next_step()
    assert len(batches) == 2
    for (x, y), ids in zip(batches, loader.last_sample_ids, strict=True):
        assert x.shape == y.shape == (2, SEQ) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        for row, w in zip(x, ids, strict=True):
            assert row.tolist() == list(range(w * SEQ, w * SEQ + SEQ))


def test_same_seed_same_batches_other_seed_differs():
    a, b, c = _loaders(1, seed=3)[0], _loaders(1, seed=3)[0], _loaders(1, seed=4)[0]
    ids_a, ids_b, ids_c = ([_step_windows([loader]) for _ in range(3)] for loader in (a, b, c))
    assert ids_a == ids_b and ids_a != ids_c


def test_resume_from_state_dict_gives_identical_next_batches():
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
    loader = _loaders(1, gbs=12, mb=4)[0]  # 50 windows, 12 per step: steps straddle epoch ends
    seen = []
    for _ in range(25):  # 300 samples = exactly 6 epochs
        seen.extend(w for r in _step_windows([loader]) for w in r)
    epochs = [seen[i * 50 : (i + 1) * 50] for i in range(6)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))
    assert epochs[0] != epochs[1]


def test_load_state_dict_rejects_other_seq_len_or_corpus():
    state = _loaders(1)[0].state_dict()
    other = DistributedBatchLoader(torch.arange(30 * SEQ + 1), SEQ, 16, 2, 0, 1, 0)
    with pytest.raises(ValueError, match="n_windows"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        DistributedBatchLoader(TOKENS, SEQ // 2, 16, 2, 0, 1, 0).load_state_dict(state)


def test_bad_batch_layout_or_tiny_data_rejected():
    with pytest.raises(ValueError, match=r"training\.global_batch_size"):
        DistributedBatchLoader(TOKENS, SEQ, 12, 4, 0, 2, 0)
    with pytest.raises(ValueError, match="window"):
        DistributedBatchLoader(torch.arange(SEQ), SEQ, 2, 1, 0, 1, 0)


def test_eval_batches_deterministic_and_disjoint_across_ranks():
    per_rank = [eval_batches(TOKENS, SEQ, 2, 3, r, 4) for r in range(4)]
    assert all(len(b) == 3 for b in per_rank)
    starts = [int(x[i, 0]) // SEQ for batches in per_rank for x, _ in batches for i in range(2)]
    assert len(starts) == len(set(starts)) == 24
    assert max(starts) - min(starts) > 40  # spread over the whole validation set, not its head
    again = eval_batches(TOKENS, SEQ, 2, 3, 1, 4)
    for (x1, y1), (x2, y2) in zip(per_rank[1], again, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(y1[:, :-1], x1[:, 1:])


def test_eval_batches_wrap_when_validation_is_small():
    tokens = torch.arange(3 * SEQ + 1)
    batches = eval_batches(tokens, SEQ, 2, 4, 0, 2)
    assert len(batches) == 4 and all(x.shape == (2, SEQ) for x, _ in batches)
