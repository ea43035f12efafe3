"""The last data step: surviving documents -> lmstack token files that ``lmstack train`` reads (docs/data.md).

Each document's ids (lmstack's tokenizer, its native core when built) are followed by EOS, so documents
never run together and token files can be concatenated (``lmstack.train.data.split_documents`` cuts after
each EOS). Each task writes one token file, ``output/{prefix}{rank:05d}.bin`` (:mod:`lmstack.tokenizer.token_file`:
raw ``uint16`` / ``uint32`` ids plus the JSON sidecar ``.bin.json``), atomically: complete with its sidecar or
absent. A stage has one task per input shard by default, so one input shard gives one token file;
:func:`tokenize_shards` runs that stage on the local executor's processes and :func:`concat_token_files`
joins the files into the single one ``lmstack train`` takes.

Text in documents is data, not markup: a literal ``<|endoftext|>`` in a crawled page is encoded as text
(``allow_special=False``), and lone surrogates (from JSON ``\\ud800`` escapes) become U+FFFD, as tiktoken
does, counted in ``stats.counters["surrogate_documents"]``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from lmstack.data.document import Document
from lmstack.data.executor import LocalExecutor
from lmstack.data.pipeline import Pipeline
from lmstack.data.readers import JsonlReader
from lmstack.data.report import merge_stats
from lmstack.data.step import StepStats, register_step
from lmstack.data.writers import ShardWriter, clear_task_files
from lmstack.tokenizer import Tokenizer, load_tokenizer, open_tokens, read_sidecar, token_dtype
from lmstack.tokenizer.token_file import sidecar_path, write_sidecar
from lmstack.utils import atomic_path

_BATCH_CHARS = (
    4 << 20
)  # characters encoded per native call (bounds memory whatever the shard's size)
_LOADED: dict[str, Tokenizer] = {}  # tokenizer path -> loaded, once per worker process


def eos_id(tok: Tokenizer, eos: str | int | None = None) -> int:
    """The id written after every document: ``eos`` (a special token string or an id), else the tokenizer's
    ``eos_token_id``, else ``<|endoftext|>``; a ValueError names the choices when none applies."""
    if isinstance(eos, int) and not isinstance(eos, bool):
        if not 0 <= eos < tok.vocab_size:
            raise ValueError(f"eos={eos} is not a token id of this tokenizer (V={tok.vocab_size})")
        return eos
    if isinstance(eos, str):
        if eos not in tok.special_tokens:
            raise ValueError(
                f"eos={eos!r} is not one of the tokenizer's special tokens {sorted(tok.special_tokens)}"
            )
        return tok.special_tokens[eos]
    if eos is not None:
        raise ValueError(f"eos={eos!r} must be a special token string, a token id or None")
    if tok.eos_token_id is not None:
        return tok.eos_token_id
    if "<|endoftext|>" in tok.special_tokens:
        return tok.special_tokens["<|endoftext|>"]
    raise ValueError(
        f"the tokenizer has no eos_token_id and no <|endoftext|>; pass eos= one of "
        f"{sorted(tok.special_tokens)} or a token id"
    )


def _clean(text: str) -> tuple[str, bool]:
    """``text`` with lone surrogates replaced by U+FFFD (a surrogate pair becomes its character), and whether
    any were there."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), True


@register_step("tokenize")
class Tokenize(ShardWriter):
    """Writes the documents it sees to this task's token file and passes them on.

    ``tokenizer``: a :class:`~lmstack.tokenizer.Tokenizer` or a path :func:`~lmstack.tokenizer.load_tokenizer`
    reads (loaded in the worker, once per process). ``eos``: a special token or an id (default: the
    tokenizer's EOS, else ``<|endoftext|>``). Empty documents are dropped (reason ``empty_text``): they
    would add a lone EOS. Counters: ``tokens`` (ids written, EOS included: the file's length),
    ``surrogate_documents``, ``shards``.
    """

    config_ignore = ("num_threads",)  # the ids do not depend on it

    name = "tokenize"
    suffix = ".bin"

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike,
        output: str | os.PathLike,
        eos: str | int | None = None,
        allow_special: bool = False,
        num_threads: int = 1,
        prefix: str = "",
    ) -> None:
        super().__init__(output, prefix=prefix)
        if not isinstance(tokenizer, Tokenizer):
            if not Path(tokenizer).exists():
                raise FileNotFoundError(f"tokenize: tokenizer {str(tokenizer)!r} does not exist")
            tokenizer = os.path.abspath(tokenizer)
        self.tokenizer = tokenizer
        if isinstance(tokenizer, Tokenizer):
            eos_id(tokenizer, eos)  # a bad eos is an error now, not in a worker
        self.eos = eos
        self.allow_special = bool(allow_special)
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"tokenize: num_threads={num_threads!r} must be an integer >= 1")
        self.num_threads = num_threads

    def load(self) -> Tokenizer:
        if isinstance(self.tokenizer, Tokenizer):
            return self.tokenizer
        if self.tokenizer not in _LOADED:
            _LOADED[self.tokenizer] = load_tokenizer(self.tokenizer)
        return _LOADED[self.tokenizer]

    def token_file(self) -> Path:
        """This task's output: ``output/{prefix}{rank:05d}.bin``."""
        return Path(self.output) / f"{self.prefix}{self.rank:05d}{self.suffix}"

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        tok = self.load()
        eos, dtype, out = eos_id(tok, self.eos), token_dtype(tok.vocab_size), self.token_file()
        clear_task_files(
            out.parent, out.name
        )  # what a killed run of this task left (no completion marker)
        n_docs = n_bytes = 0
        stats.counters["tokens"] += 0
        with (
            atomic_path(out) as tmp,
            open(tmp, "wb") as f,
        ):  # an exception or an early close: nothing written
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
                    stats.counters["tokens"] += self._encode(tok, batch, dtype, eos, f)
                    batch, size = [], 0
                stats.kept(doc)
                yield doc
            stats.counters["tokens"] += self._encode(tok, batch, dtype, eos, f)
            f.flush()
        n_tokens = stats.counters["tokens"]
        write_sidecar(
            out,
            {
                "dtype": dtype.name,
                "n_tokens": n_tokens,
                "vocab_size": tok.vocab_size,
                "n_documents": n_docs,
                "n_bytes": n_bytes,
                "eos_id": eos,
                "bytes_per_token": n_bytes / max(n_tokens - n_docs, 1),
            },
        )
        stats.counters["shards"] += 1

    def _encode(self, tok: Tokenizer, texts: list[str], dtype: np.dtype, eos: int, f) -> int:
        if not texts:
            return 0
        ids = tok.encode_concat(
            texts, dtype, sep_id=eos, allow_special=self.allow_special, num_threads=self.num_threads
        )
        f.write(ids.tobytes())
        return len(ids)


def tokenize_shards(
    shards: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer | str | os.PathLike,
    logs: str | os.PathLike,
    eos: str | int | None = None,
    allow_special: bool = False,
    num_workers: int = 1,
    progress: bool = False,
) -> tuple[list[Path], StepStats]:
    """JSONL shards of documents -> one token file per shard in ``out_dir`` (``00000.bin``, ... in the
    shards' sorted order), as one pipeline stage (``read_jsonl`` + ``tokenize``, one task per shard) on the
    local executor with ``num_workers`` processes; ``logs`` gets the stage's stats and completion markers, so
    a relaunch skips finished shards. Returns the token files and the tokenize step's stats over all tasks."""
    reader = JsonlReader([str(s) for s in shards])
    step = Tokenize(tokenizer, out_dir, eos=eos, allow_special=allow_special)
    world = len(reader.files())
    LocalExecutor(num_workers, progress=progress).run(
        Pipeline.from_steps([reader, step], logs, tasks=world, name="tokenize")
    )
    stats = next(s for s in merge_stats(logs)["tokenize"]["steps"] if s.name == step.name)
    return [step.for_task(r, world).token_file() for r in range(world)], stats


def concat_token_files(paths: Sequence[str | os.PathLike], output: str | os.PathLike) -> int:
    """Join token files (same dtype and vocabulary) into one, in order, atomically; returns its token count."""
    if not paths:
        raise ValueError("concat_token_files needs at least one token file")
    infos = [read_sidecar(p) for p in paths]
    if len({(i.dtype, i.vocab_size) for i in infos}) != 1:
        kinds = ", ".join(f"{p}: {i.dtype}/V={i.vocab_size}" for p, i in zip(paths, infos))
        raise ValueError(
            f"token files differ in dtype or vocab_size ({kinds}); encode them with one tokenizer"
        )
    n = 0
    with atomic_path(output) as tmp, open(tmp, "wb") as f:
        for p, info in zip(paths, infos):
            if info.n_tokens == 0:  # a shard whose documents were all empty
                continue
            data = open_tokens(p)
            for start in range(0, len(data), 1 << 24):
                f.write(np.asarray(data[start : start + (1 << 24)]).tobytes())
            n += len(data)
        sidecar_path(output).unlink(missing_ok=True)
    write_sidecar(
        output,
        {
            "dtype": infos[0].dtype.name,
            "n_tokens": n,
            "vocab_size": infos[0].vocab_size,
            "inputs": [str(p) for p in paths],
        },
    )
    return n
