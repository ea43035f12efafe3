"""encode_iterable keeps memory flat over a large file (measured with tracemalloc)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

LINE_WORDS = (
    "the quick brown fox jumps over the lazy dog 你好 世界 😀 def return 0123 <|endoftext|>".split()
)


def write_file(path, n_bytes: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < n_bytes:
            line = " ".join(rng.choices(LINE_WORDS, k=rng.randint(0, 20))) + "\n" * rng.randint(
                1, 3
            )
            f.write(line)
            written += len(line.encode())


def peak_while_streaming(tok, path) -> tuple[int, int]:
    n = 0
    tracemalloc.start()
    try:
        with open(path, encoding="utf-8") as f:
            for _ in tok.encode_iterable(f):
                n += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, n


@pytest.mark.slow
def test_memory_flat_in_input_size(trained, tmp_path):
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    write_file(small, 256 << 10)
    write_file(large, 3 << 19, seed=1)
    peak_small, n_small = peak_while_streaming(trained, small)
    peak_large, n_large = peak_while_streaming(trained, large)
    assert n_large > 4 * n_small
    # ids for the whole 1.5 MB file would take > 8 bytes * n_large in a list; the stream holds a chunk
    assert peak_large < 2 * peak_small + (1 << 20), (peak_small, peak_large)
    assert peak_large < 8 * n_large / 4


def test_stream_of_a_file_equals_whole_text(trained, tmp_path):
    path = tmp_path / "f.txt"
    write_file(path, 200_000, seed=2)
    text = path.read_text(encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        assert list(trained.encode_iterable(f, chunk_chars=4096)) == trained.encode(text)
