"""Writers: documents out to JSONL (plain, .gz, .zst) or Parquet shards, and the exclusion writer.

Every shard is written atomically (a temporary file beside it, renamed when complete: ``utils.atomic_path``),
so a shard on disk is whole or absent. Shards are named after the task, ``{prefix}{rank:05d}_{shard:05d}``
plus the suffix; a new shard starts after ``max_docs`` documents or ``max_bytes`` bytes of (uncompressed)
records. When a task starts, its writer deletes that task's earlier shards and temporary files (left by a
killed run: the task had no completion marker, so they are not trusted), so a relaunch writes the same files.
Output is byte-identical run to run: gzip headers carry no time or name, zstd and Parquet are deterministic.

A JSONL record is ``{"id", "text", "metadata"}`` (dolma's layout; :class:`~lmstack.data.readers.JsonlReader`
reads it back with the same ids). Bytes in metadata (the WARC reader's ``raw``) are never written. Writers
pass every document on, so a writer may sit mid-pipeline (keep the text, then tokenize it).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lmstack.data.document import Document
from lmstack.data.step import Step, StepStats, register_step
from lmstack.utils import atomic_path

COMPRESSIONS = {
    None: "",
    "": "",
    "none": "",
    "gz": ".gz",
    "gzip": ".gz",
    "zst": ".zst",
    "zstd": ".zst",
}
PARQUET_COMPRESSIONS = ("zstd", "snappy", "gzip", "brotli", "lz4", "none")  # pyarrow's codecs


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy scalars and arrays (classifier scores)
        return o.tolist()
    raise TypeError(f"metadata value {o!r} of type {type(o).__name__} is not JSON-serialisable")


def record(doc: Document, **extra: Any) -> dict[str, Any]:
    """The JSON object written for ``doc`` (bytes metadata left out)."""
    meta = {
        k: v for k, v in doc.metadata.items() if not isinstance(v, (bytes, bytearray, memoryview))
    }
    return {"id": doc.id, **extra, "text": doc.text, "metadata": meta}


def json_line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, default=_json_default) + "\n").encode(
        "utf-8", "replace"
    )


def _abort(close, atomic) -> None:
    """Close the open file, then drop the temporary file (``atomic_path`` exited with an error): no partial shard."""
    try:
        close()
    finally:
        err = RuntimeError("shard aborted")
        try:
            atomic.__exit__(type(err), err, None)
        except RuntimeError:
            pass


class JsonlShard:
    """One JSONL file written atomically: :meth:`write` lines, then :meth:`close` (rename) or :meth:`abort`."""

    def __init__(self, path: Path, compression: str | None = None):
        self.path = Path(path)
        self._atomic = atomic_path(self.path)
        tmp = self._atomic.__enter__()
        self._raw = open(tmp, "wb")
        ext = COMPRESSIONS[compression]
        if ext == ".gz":
            self._f = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0)
        elif ext == ".zst":
            import zstandard

            self._f = zstandard.ZstdCompressor(level=3).stream_writer(self._raw, closefd=False)
        else:
            self._f = self._raw
        self.docs = self.bytes = 0

    def write(self, line: bytes) -> None:
        self._f.write(line)
        self.docs += 1
        self.bytes += len(line)

    def close(self) -> Path:
        if self._f is not self._raw:
            self._f.close()
        self._raw.close()
        self._atomic.__exit__(None, None, None)
        return self.path

    def abort(self) -> None:
        _abort(self._raw.close, self._atomic)


class ParquetShard:
    """One Parquet file (columns id, text, metadata as a JSON string) written atomically, in row groups."""

    def __init__(self, path: Path, compression: str = "zstd", row_group: int = 1024):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = Path(path)
        self._atomic = atomic_path(self.path)
        tmp = self._atomic.__enter__()
        self._schema = pa.schema(
            [("id", pa.string()), ("text", pa.string()), ("metadata", pa.string())]
        )
        self._w = pq.ParquetWriter(tmp, self._schema, compression=compression)
        self._rows: list[dict[str, str]] = []
        self._row_group = row_group
        self.docs = self.bytes = 0

    def write(self, doc: Document) -> None:
        rec = record(doc)
        meta = json.dumps(rec["metadata"], ensure_ascii=False, default=_json_default)
        self._rows.append({"id": doc.id, "text": doc.text, "metadata": meta})
        self.docs += 1
        self.bytes += len(doc.text.encode("utf-8", "surrogatepass")) + len(meta)
        if len(self._rows) >= self._row_group:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._rows:
            self._w.write_table(pa.Table.from_pylist(self._rows, schema=self._schema))
            self._rows = []

    def close(self) -> Path:
        self._flush()
        self._w.close()
        self._atomic.__exit__(None, None, None)
        return self.path

    def abort(self) -> None:
        _abort(self._w.close, self._atomic)


def clear_task_files(folder: Path, stem: str) -> None:
    """Remove a task's earlier outputs ``{stem}*`` and temporaries ``.{stem}*.tmp`` from ``folder``."""
    if folder.is_dir():
        for p in list(folder.glob(f"{stem}*")) + list(folder.glob(f".{stem}*.tmp")):
            if p.is_file():
                p.unlink()


class ShardWriter(Step):
    """Base of the shard writers: ``output`` folder, rollover at ``max_docs`` / ``max_bytes``, ``prefix``.

    ``split_by`` (a metadata key, e.g. ``"language"`` or ``"route"``): each value gets its own subfolder,
    ``output/<value>/`` (``unknown`` when the key is absent; characters other than letters, digits, ``-``,
    ``_`` and ``.`` become ``_``), with its own shards — routing documents by language or route to
    separate outputs."""

    suffix = ""

    def __init__(
        self,
        output: str | os.PathLike,
        max_docs: int | None = None,
        max_bytes: int | None = None,
        prefix: str = "",
        split_by: str | None = None,
    ):
        for key, v in (("max_docs", max_docs), ("max_bytes", max_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"{self.name}: {key}={v!r} must be an integer >= 1 (or absent: no rollover)"
                )
        if split_by is not None and (not isinstance(split_by, str) or not split_by):
            raise ValueError(
                f"{self.name}: split_by={split_by!r} must be a metadata key (a string)"
            )
        self.output = os.path.abspath(output)
        self.max_docs, self.max_bytes, self.prefix = max_docs, max_bytes, prefix
        self.split_by = split_by

    def _open(self, index: int, folder: Path):
        raise NotImplementedError

    def _write(self, shard, doc: Document) -> None:
        raise NotImplementedError

    def shard_path(self, index: int, folder: Path | None = None) -> Path:
        name = f"{self.prefix}{self.rank:05d}_{index:05d}{self.suffix}"
        return Path(folder or self.output) / name

    def _folder(self, doc: Document) -> Path:
        if self.split_by is None:
            return Path(self.output)
        value = doc.metadata.get(self.split_by)
        name = _SAFE.sub("_", str(value)).lstrip(".") if value not in (None, "") else ""
        return Path(self.output) / (name or "unknown")

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        folder = Path(self.output)
        stem = f"{self.prefix}{self.rank:05d}_"
        clear_task_files(folder, stem)
        if self.split_by is not None and folder.is_dir():
            for sub in folder.iterdir():
                if sub.is_dir():
                    clear_task_files(sub, stem)
        open_: dict[Path, list] = {}  # folder -> [open shard or None, its index]
        try:
            for doc in docs:
                stats.seen(doc)
                slot = open_.setdefault(self._folder(doc), [None, 0])
                if slot[0] is None:
                    slot[0] = self._open(slot[1], self._folder(doc))
                shard = slot[0]
                self._write(shard, doc)
                stats.kept(doc)
                if (self.max_docs and shard.docs >= self.max_docs) or (
                    self.max_bytes and shard.bytes >= self.max_bytes
                ):
                    shard.close()
                    stats.counters["shards"] += 1
                    slot[0], slot[1] = None, slot[1] + 1
                yield doc
        except BaseException:
            for shard, _ in open_.values():
                if shard is not None:
                    shard.abort()
            raise
        for key in sorted(open_):
            if open_[key][0] is not None:
                open_[key][0].close()
                stats.counters["shards"] += 1


_SAFE = re.compile(r"[^\w.-]")


@register_step("write_jsonl")
class JsonlWriter(ShardWriter):
    """JSONL shards in ``output``; ``compression`` None, "gz" or "zst"."""

    def __init__(
        self,
        output,
        compression: str | None = "gz",
        max_docs=None,
        max_bytes=None,
        prefix="",
        split_by: str | None = None,
    ):
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"write_jsonl: compression={compression!r}; expected one of None, 'gz', 'zst'"
            )
        super().__init__(output, max_docs, max_bytes, prefix, split_by)
        self.compression = compression
        self.suffix = ".jsonl" + COMPRESSIONS[compression]

    def _open(self, index, folder):
        return JsonlShard(self.shard_path(index, folder), self.compression)

    def _write(self, shard, doc):
        shard.write(json_line(record(doc)))


@register_step("write_parquet")
class ParquetWriter(ShardWriter):
    """Parquet shards in ``output`` (zstd-compressed columns id, text, metadata-as-JSON)."""

    suffix = ".parquet"

    def __init__(
        self,
        output,
        compression: str = "zstd",
        max_docs=None,
        max_bytes=None,
        prefix="",
        row_group: int = 1024,
        split_by: str | None = None,
    ):
        if compression not in PARQUET_COMPRESSIONS:
            raise ValueError(
                f"write_parquet: compression={compression!r}; expected one of {PARQUET_COMPRESSIONS}"
            )
        if isinstance(row_group, bool) or not isinstance(row_group, int) or row_group < 1:
            raise ValueError(f"write_parquet: row_group={row_group!r} must be an integer >= 1")
        super().__init__(output, max_docs, max_bytes, prefix, split_by)
        self.compression, self.row_group = compression, row_group

    def _open(self, index, folder):
        return ParquetShard(self.shard_path(index, folder), self.compression, self.row_group)

    def _write(self, shard, doc):
        shard.write(doc)


class ExclusionWriter:
    """Keeps what a task dropped: ``{"id", "step", "reason", "text", "metadata"}`` per document, in
    ``folder/{rank:05d}.jsonl.gz``, written atomically when the task ends (:meth:`close`). The executor
    sets it as every step's ``StepStats.on_drop``; a task that drops nothing writes no file."""

    def __init__(self, folder: str | os.PathLike, rank: int, compression: str | None = "gz"):
        self.folder, self.rank, self.compression = Path(folder), rank, compression
        self.path = self.folder / f"{rank:05d}.jsonl{COMPRESSIONS[compression]}"
        self._shard: JsonlShard | None = None
        clear_task_files(self.folder, f"{rank:05d}.")

    def __call__(self, doc: Document, step: str, reason: str) -> None:
        if self._shard is None:
            self._shard = JsonlShard(self.path, self.compression)
        self._shard.write(json_line(record(doc, step=step, reason=reason)))

    def close(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None

    def abort(self) -> None:
        if self._shard is not None:
            self._shard.abort()
            self._shard = None


def read_records(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL shard this module wrote (any compression), for tests and tools."""
    path = Path(path)
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    elif path.name.endswith(".zst"):
        import zstandard

        data = (
            zstandard.ZstdDecompressor()
            .stream_reader(io.BytesIO(data), read_across_frames=True)
            .read()
        )
    for line in data.splitlines():
        if line.strip():
            yield json.loads(line)
