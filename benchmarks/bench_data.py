"""Character-tokenizer encoding speed: ``CharTokenizer.encode_tensor`` on the Shakespeare corpus.

Every rank encodes the whole training text at start-up, so this is start-up time per run.
Times the vectorised encoder against nanoGPT's per-character loop (``[stoi[c] for c in s]``,
the regression ``tests/unit/test_data.py`` guards by counting work, not time), the median of
``--repeats`` runs each, after one untimed warm-up. Writes ``--out`` and prints the figures last.

    OMP_NUM_THREADS=1 python benchmarks/bench_data.py
    OMP_NUM_THREADS=1 python benchmarks/bench_data.py --chars 10000 --repeats 1 --out /tmp/data.json  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loomtrain.data import CharTokenizer, shakespeare_plays

RESULTS = Path(__file__).resolve().parent / "results" / "data.json"


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chars", type=int, default=None, help="encode only the corpus's first N characters")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    text = "".join(shakespeare_plays().values())[: args.chars]
    tok = CharTokenizer.from_text(text)
    stoi = {c: i for i, c in enumerate(tok.chars)}
    ours = median_seconds(lambda: tok.encode_tensor(text), args.repeats)
    loop = median_seconds(lambda: torch.tensor([stoi[c] for c in text]), args.repeats)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "chars": len(text),
        "repeats": args.repeats,
        "encode_s": ours,
        "chars_per_s": len(text) / ours,
        "per_char_loop_s": loop,
        "speedup": loop / ours,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{len(text) / 1e6:.2f} M characters: per-character loop {loop:.3f} s")
    print(f"encode_tensor {ours:.3f} s ({len(text) / ours / 1e6:.0f} M chars/s), {loop / ours:.0f}x faster")


if __name__ == "__main__":
    main()
