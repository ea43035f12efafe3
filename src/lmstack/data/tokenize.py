"""The last data step: surviving documents -> lmstack token files that ``lmstack train`` reads (docs/data.md).

Each document's ids (lmstack's tokenizer, its native core when built) are followed by EOS, so documents
never run together and shards can be concatenated (``lmstack.train.data.split_documents`` cuts after each
EOS). One input shard gives one token file (:mod:`lmstack.tokenizer.token_file`: raw ``uint16`` / ``uint32``
ids plus a JSON sidecar), written atomically: a token file is complete with its sidecar or absent.
:func:`tokenize_shards` runs one task per shard on worker processes; :func:`concat_token_files` joins the
shards into the single file ``lmstack train --train-data`` takes.

Text in documents is data, not markup: a literal ``<|endoftext|>`` in a crawled page is encoded as text
(``allow_special=False``), and lone surrogates (from JSON ``\\ud800`` escapes) become U+FFFD, as tiktoken
does, counted in ``stats.counters["surrogate_documents"]``.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmstack.data.document import Document
from lmstack.data.step import Step, StepStats
from lmstack.threads import available_cpus
from lmstack.tokenizer import Tokenizer, load_tokenizer, open_tokens, read_sidecar, token_dtype
from lmstack.tokenizer.token_file import sidecar_path, write_sidecar
from lmstack.utils import atomic_path

_BATCH_CHARS = 4 << 20  # characters encoded per native call (bounds memory whatever the shard's size)


def eos_id(tok: Tokenizer, eos: str | int | None = None) -> int:
    """The id written after every document: ``eos`` (a special token string or an id), else the tokenizer's
    ``eos_token_id``, else ``<|endoftext|>``; a ValueError names the choices when none applies."""
    if isinstance(eos, int) and not isinstance(eos, bool):
        if not 0 <= eos < tok.vocab_size:
            raise ValueError(f"eos={eos} is not a token id of this tokenizer (V={tok.vocab_size})")
        return eos
    if isinstance(eos, str):
        if eos not in tok.special_tokens:
            raise ValueError(f"eos={eos!r} is not one of the tokenizer's special tokens {sorted(tok.special_tokens)}")
        return tok.special_tokens[eos]
    if eos is not None:
        raise ValueError(f"eos={eos!r} must be a special token string, a token id or None")
    if tok.eos_token_id is not None:
        return tok.eos_token_id
    if "<|endoftext|>" in tok.special_tokens:
        return tok.special_tokens["<|endoftext|>"]
    raise ValueError(f"the tokenizer has no eos_token_id and no <|endoftext|>; pass eos= one of "
                     f"{sorted(tok.special_tokens)} or a token id")


def _clean(text: str) -> tuple[str, bool]:
    """``text`` with lone surrogates replaced by U+FFFD (a surrogate pair becomes its character), and whether
    any were there."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), True


class Tokenize(Step):
    """Writes the documents it sees to the token file ``output`` (ids + EOS per document) and passes them on.

    Empty documents are dropped (reason ``empty_text``): they would add a lone EOS. Counters:
    ``tokens`` (ids written, EOS included: the file's length), ``surrogate_documents``.
    """

    name = "tokenize"

    def __init__(self, tokenizer: Tokenizer | str | os.PathLike, output: str | os.PathLike,
                 eos: str | int | None = None, allow_special: bool = False, num_threads: int = 1) -> None:
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.output = Path(output)
        self.eos_id = eos_id(self.tokenizer, eos)
        self.allow_special = bool(allow_special)
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r} must be an integer >= 1")
        self.num_threads = num_threads
        self.dtype = token_dtype(self.tokenizer.vocab_size)

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        tok, out = self.tokenizer, self.output
        n_docs = n_bytes = 0
        stale = sidecar_path(out)
        with atomic_path(out) as tmp, open(tmp, "wb") as f:  # an exception or an early close: nothing written
            batch: list[str] = []
            size = 0
            for doc in docs:
                stats.seen(doc)
                if not doc.text:
                    stats.drop(doc, "empty_text")
                    continue
                text, had_surrogates = _clean(doc.text)
                if had_surrogates:
                    stats.counters["surrogate_documents"] += 1
                batch.append(text)
                size += len(text)
                n_docs += 1
                n_bytes += len(text.encode("utf-8"))
                if size >= _BATCH_CHARS:
                    stats.counters["tokens"] += self._write(batch, f)
                    batch, size = [], 0
                stats.kept(doc)
                yield doc
            stats.counters["tokens"] += self._write(batch, f)
            f.flush()
            stale.unlink(missing_ok=True)  # an old sidecar never describes the new file
        n_tokens = stats.counters["tokens"]
        write_sidecar(out, {"dtype": self.dtype.name, "n_tokens": n_tokens, "vocab_size": tok.vocab_size,
                            "n_documents": n_docs, "n_bytes": n_bytes, "eos_id": self.eos_id,
                            "bytes_per_token": n_bytes / max(n_tokens - n_docs, 1)})

    def _write(self, texts: list[str], f) -> int:
        if not texts:
            return 0
        ids = self.tokenizer.encode_concat(texts, self.dtype, sep_id=self.eos_id, allow_special=self.allow_special,
                                           num_threads=self.num_threads)
        f.write(ids.tobytes())
        return len(ids)


def read_jsonl_documents(path: str | os.PathLike) -> Iterator[Document]:
    """Documents of a JSONL shard (plain or ``.gz``), one ``{"text", "id", "metadata"}`` object per line."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                yield Document(obj["text"], str(obj["id"]), obj.get("metadata") or {})
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with 'text' and 'id': {e!r}") from None


def shard_output(shard: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """``out_dir/<shard name without its extensions>.bin`` (``00003.jsonl.gz`` -> ``00003.bin``)."""
    return Path(out_dir) / (Path(shard).name.split(".")[0] + ".bin")


_WORKER: list = []


def _init(step_args: dict, read: Callable[[Path], Iterable[Document]]) -> None:
    _WORKER[:] = [step_args, read]


def _task(job: tuple[str, str]) -> dict:
    shard, output = job
    step_args, read = _WORKER
    step = Tokenize(output=output, **step_args)
    stats = StepStats(step.name)
    for _ in step(read(Path(shard)), stats):
        pass
    return stats.to_dict()


def tokenize_shards(shards: Sequence[str | os.PathLike], out_dir: str | os.PathLike,
                    tokenizer: Tokenizer | str | os.PathLike, eos: str | int | None = None,
                    allow_special: bool = False, num_workers: int | None = None,
                    read: Callable[[Path], Iterable[Document]] = read_jsonl_documents,
                    progress: bool | None = None) -> tuple[list[Path], StepStats]:
    """One token file per input shard (:func:`shard_output`), shards on ``num_workers`` processes (default:
    the CPUs available); returns the outputs in shard order and the stats of all tasks merged."""
    shards = [Path(s) for s in shards]
    outputs = [shard_output(s, out_dir) for s in shards]
    seen: dict[Path, Path] = {}
    for s, o in zip(shards, outputs):
        if not s.is_file():
            raise FileNotFoundError(f"input shard {str(s)!r} does not exist or is not a file")
        if o in seen:
            raise ValueError(f"shards {str(seen[o])!r} and {str(s)!r} would both write {str(o)!r}; rename one")
        seen[o] = s
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    step_args = {"tokenizer": tok, "eos": eos_id(tok, eos), "allow_special": allow_special}
    workers = max(1, min(num_workers or available_cpus(), len(shards)))
    jobs = [(str(s), str(o)) for s, o in zip(shards, outputs)]
    total = StepStats(Tokenize.name)
    bar = tqdm(total=len(jobs), unit="shard", desc="tokenize", disable=(not progress) if progress is not None else None)
    if workers == 1:
        _init(step_args, read)
        results: Iterable[dict] = map(_task, jobs)
        pool = None
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(workers, initializer=_init, initargs=(step_args, read))
        results = pool.imap(_task, jobs)  # in shard order
    try:
        for d in results:
            total = total.merge(StepStats.from_dict(d))
            bar.update(1)
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
    return outputs, total


def concat_token_files(paths: Sequence[str | os.PathLike], output: str | os.PathLike) -> int:
    """Join token files (same dtype and vocabulary) into one, in order, atomically; returns its token count."""
    if not paths:
        raise ValueError("concat_token_files needs at least one token file")
    infos = [read_sidecar(p) for p in paths]
    if len({(i.dtype, i.vocab_size) for i in infos}) != 1:
        kinds = ", ".join(f"{p}: {i.dtype}/V={i.vocab_size}" for p, i in zip(paths, infos))
        raise ValueError(f"token files differ in dtype or vocab_size ({kinds}); encode them with one tokenizer")
    n = 0
    with atomic_path(output) as tmp, open(tmp, "wb") as f:
        for p, info in zip(paths, infos):
            if info.n_tokens == 0:  # a shard whose documents were all empty
                continue
            data = open_tokens(p)
            for start in range(0, len(data), 1 << 24):
                f.write(np.asarray(data[start:start + (1 << 24)]).tobytes())
            n += len(data)
        sidecar_path(output).unlink(missing_ok=True)
    write_sidecar(output, {"dtype": infos[0].dtype.name, "n_tokens": n, "vocab_size": infos[0].vocab_size,
                           "inputs": [str(p) for p in paths]})
    return n
