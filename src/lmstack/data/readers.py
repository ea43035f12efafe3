"""Readers: files in, :class:`Document` out. WARC / WET (fastwarc), JSONL (plain, .gz, .zst), Parquet, text.

A reader is the first step of a stage: it ignores its input stream and reads its task's share of the input
files (sorted, every ``world``-th from ``rank``: file ``i`` goes to task ``i % world``). Inputs are files,
folders (every file below with the reader's suffixes, or matching ``glob``; hidden files skipped) or glob
patterns. A document's ``source`` is the input as written plus the path below a folder, so ids do not depend
on the working directory's absolute path.

Ids (:func:`~lmstack.data.document.stable_id`) depend only on where a document came from:

- WARC/WET: ``stable_id(source, WARC-Record-ID)``;
- JSONL/Parquet: the record's own ``id`` when it has one (a shard this package wrote keeps its ids), else
  ``stable_id(source, line number)`` (JSONL, 1-based) or ``stable_id(source, row index)`` (Parquet, 0-based);
- text: ``stable_id(source, 0)`` (one document per file).

**WARC response records are not text yet.** The reader puts the HTTP body, undecoded, in
``doc.metadata["raw"]`` (bytes) with the HTTP ``Content-Type`` header in ``doc.metadata["content_type"]``
(``""`` when absent) and leaves ``doc.text == ""`` (chunked transfer and gzip/deflate content encodings are
undone; the charset is the extractor's to detect); the extraction step (:mod:`lmstack.data.extract`) turns
``raw`` into text and removes it. Writers never write ``raw``. Other metadata: ``url``, ``source``,
``warc_date``, ``warc_record_id``, ``http_status``.

Bad input never ends the run. Per record (the record is dropped with ``stats.drop(doc, reason)``, the doc a
placeholder with empty text and ``metadata["source"]``): ``empty``, ``too_long`` (over ``max_doc_bytes``;
a 100 MB line is skipped without being held in memory), ``bad_json``, ``no_text``, ``truncated_record``
(a WARC record shorter than its Content-Length), ``no_http_body``. Per file (everything read before the
fault is kept; the file counts as one more record in, dropped; the placeholder's ``metadata["error"]`` says
what broke, and a warning names the file):
``truncated_file`` (gzip/zstd stream cut short), ``corrupt_compression`` (also a corrupt gzip WARC), ``corrupt_parquet``,
``unreadable_file``. Undecodable UTF-8 is replaced by U+FFFD and counted in ``counters["utf8_replaced"]``
(WARC bodies are left to the extractor, which detects their encoding).
"""

from __future__ import annotations

import glob as globlib
import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lmstack.data.document import Document, stable_id
from lmstack.data.step import Step, StepStats, register_step

log = logging.getLogger("lmstack.data")

CHUNK = 1 << 20  # bytes read (or decompressed) at a time
MAX_DOC_BYTES = 16 << 20  # records larger than this are dropped as too_long


class Truncated(Exception):
    """A compressed stream that ends before its end-of-stream marker."""


class Reader(Step):
    """Base reader: resolves ``paths`` to a sorted file list, reads its task's share through :meth:`read`."""

    suffixes: tuple[str, ...] = ()  # what a folder input contributes (when no glob is given)

    def __init__(
        self,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        glob: str | None = None,
        limit: int | None = None,
        max_doc_bytes: int = MAX_DOC_BYTES,
    ):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError(
                f"{self.name}: paths is empty; expected input files, folders or glob patterns"
            )
        if max_doc_bytes < 1:
            raise ValueError(f"{self.name}: max_doc_bytes={max_doc_bytes!r} must be >= 1")
        # (as written, absolute): relative inputs resolve against the directory the pipeline was built in,
        # so worker processes and Ray tasks with another working directory read the same files
        self.paths = [(p, os.path.abspath(p)) for p in paths]
        self.glob, self.limit, self.max_doc_bytes = glob, limit, max_doc_bytes
        self._files: list[tuple[str, Path]] | None = None

    def files(self) -> list[tuple[str, Path]]:
        """Every input file as (source name, absolute path), sorted by source; a missing input is an error.

        Listed once and kept: the executor lists them before it ships the stage to its tasks, so every task
        splits the same list (and a stage reading the stage before's output lists it after that stage ran).
        """
        if self._files is None:
            self._files = self._list()
        return self._files

    def _list(self) -> list[tuple[str, Path]]:
        out: dict[str, Path] = {}
        for given, full in self.paths:
            if any(c in given for c in "*?["):
                matches = sorted(globlib.glob(full, recursive=True))
                for m in matches:
                    if os.path.isfile(m):
                        out[_glob_source(given, full, m)] = Path(m)
                if not matches:
                    raise FileNotFoundError(f"{self.name}: no file matches {given!r}")
            elif os.path.isdir(full):
                root = Path(full)
                for p in root.rglob(self.glob or "*"):
                    rel = p.relative_to(root)
                    if any(part.startswith(".") for part in rel.parts) or not p.is_file():
                        continue
                    if self.glob is None and self.suffixes and not p.name.endswith(self.suffixes):
                        continue
                    out[f"{given.rstrip('/')}/{rel.as_posix()}"] = p
            elif os.path.isfile(full):
                out[Path(given).as_posix()] = Path(full)
            else:
                raise FileNotFoundError(f"{self.name}: input {given!r} does not exist")
        return sorted(out.items())

    def task_files(self) -> list[tuple[str, Path]]:
        return self.files()[self.rank :: self.world]

    def read(self, path: Path, source: str, stats: StepStats) -> Iterator[Document]:
        raise NotImplementedError

    def run(self, docs: Iterable[Document], stats: StepStats) -> Iterator[Document]:
        n = 0
        for source, path in self.task_files():
            try:
                for doc in self.read(path, source, stats):
                    yield doc
                    n += 1
                    if self.limit is not None and n >= self.limit:
                        return
            except Exception as e:
                reason = _file_fault(e)
                if reason is None:
                    raise
                _drop_file(stats, source, reason, e)


def _file_fault(e: Exception) -> str | None:
    """The reason a file-level fault is counted under; None for an exception that is a bug, not bad input."""
    module = type(e).__module__
    if isinstance(e, (Truncated, EOFError)):
        return "truncated_file"
    if module.startswith("pyarrow"):
        return "corrupt_parquet"
    if (
        isinstance(e, (gzip.BadGzipFile, zlib.error))
        or module.startswith("zstandard")
        or "zstd" in str(e).lower()
        or "decompression error" in str(e).lower()  # fastwarc's OSError for a corrupt gzip/lz4 WARC
    ):
        return "corrupt_compression"
    if isinstance(e, OSError):
        return "unreadable_file"
    return None


def _glob_root(pattern: str) -> str:
    """The folder part of a glob pattern before its first wildcard."""
    parts = Path(pattern).parts
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return str(Path(*parts[:i]))
    return str(Path(pattern).parent)


def _glob_source(given: str, full: str, match: str) -> str:
    """A glob match's source name: the pattern's folder as written plus the path below it."""
    return Path(_glob_root(given), os.path.relpath(match, _glob_root(full))).as_posix()


def _drop_file(stats: StepStats, source: str, reason: str, error: BaseException) -> None:
    """A file that broke mid-way: keep what was read, count the file under ``reason``, warn naming it."""
    msg = f"{type(error).__name__}: {error}"
    log.warning("%s: %s (%s); the documents read before it are kept", source, reason, msg)
    stats.docs_in += 1
    stats.drop(Document("", stable_id(source, "file"), {"source": source, "error": msg}), reason)


def _drop(
    stats: StepStats,
    source: str,
    key: str | int,
    reason: str,
    nbytes: int = 0,
    meta: dict[str, Any] | None = None,
    text: str = "",
) -> None:
    """Count one record in, dropped; ``text``: what the exclusion file keeps of it (a bad JSON line)."""
    stats.docs_in += 1
    stats.bytes_in += nbytes
    stats.drop(Document(text, stable_id(source, key), {"source": source, **(meta or {})}), reason)


def _emit(stats: StepStats, doc: Document, nbytes_in: int, nbytes_out: int) -> Document:
    stats.docs_in += 1
    stats.bytes_in += nbytes_in
    stats.docs_out += 1
    stats.bytes_out += nbytes_out
    return doc


def _decode(data: bytes, stats: StepStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        stats.counters["utf8_replaced"] += 1
        return data.decode("utf-8", "replace")


# ---- byte streams and lines --------------------------------------------------------------------------------


def _chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of ``path`` (by suffix: .gz, .zst, else plain), CHUNK at a time.

    A gzip or zstd stream cut short raises :class:`Truncated` after yielding every byte before the cut
    (gzip.open would lose its last read, zstandard's stream reader would end silently).
    """
    name = path.name
    if name.endswith(".gz"):
        yield from _members(path, lambda: zlib.decompressobj(wbits=31), "gzip")
    elif name.endswith(".zst"):
        import zstandard

        yield from _members(path, lambda: zstandard.ZstdDecompressor().decompressobj(), "zstd")
    else:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk


def _members(path: Path, new, what: str) -> Iterator[bytes]:
    """Decompress a file of one or more gzip members / zstd frames; :class:`Truncated` if the last is cut."""
    with open(path, "rb") as f:
        d, pending = new(), False
        while data := f.read(CHUNK):
            while data:
                out = d.decompress(data)
                pending = not d.eof
                if out:
                    yield out
                if not d.eof:
                    break
                data, d = d.unused_data, new()
        if pending:
            raise Truncated(f"{what} stream ends before its end-of-stream marker")


def _lines(chunks: Iterable[bytes], max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(1-based line number, the line without its newline) per line; None for a line over ``max_bytes``
    (its bytes are skipped as they stream past, never joined)."""
    n = 0
    carry: list[bytes] = []
    carry_len = 0
    too_long = False
    for chunk in chunks:
        parts = chunk.split(b"\n")
        for part in parts[:-1]:
            n += 1
            if too_long or carry_len + len(part) > max_bytes:
                yield n, None
            else:
                yield n, (b"".join(carry) + part if carry else part)
            carry, carry_len, too_long = [], 0, False
        tail = parts[-1]
        if tail and not too_long:
            carry_len += len(tail)
            if carry_len > max_bytes:
                carry, too_long = [], True
            else:
                carry.append(tail)
    if carry or too_long:
        yield n + 1, None if too_long else b"".join(carry)


# ---- JSONL -------------------------------------------------------------------------------------------------


def _record_document(
    obj: Any, source: str, key: int, text_key: str, id_key: str, stats: StepStats
) -> Document | str:
    """A Document from one JSON object / Parquet row, or the reason it is dropped."""
    if not isinstance(obj, dict):
        return "bad_json"
    text = obj.get(text_key)
    if not isinstance(text, str):
        return "no_text"
    if not text.strip():
        return "empty"
    rid = obj.get(id_key)
    doc_id = (
        str(rid)
        if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid)
        else stable_id(source, key)
    )
    meta = obj.get("metadata")
    if isinstance(meta, str):  # Parquet shards store metadata as a JSON string
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            meta = {"metadata": meta}
    meta = dict(meta) if isinstance(meta, dict) else ({} if meta is None else {"metadata": meta})
    for k, v in obj.items():
        if k not in (text_key, id_key, "metadata"):
            meta.setdefault(k, v)
    meta.setdefault("source", source)
    return Document(text, doc_id, meta)


@register_step("read_jsonl")
class JsonlReader(Reader):
    """One document per line of JSON: ``text_key`` (default "text") is the text, ``id_key`` (default "id") the
    id when present, ``metadata`` (an object) and every other key become metadata. .gz / .zst by suffix."""

    suffixes = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")

    def __init__(
        self,
        paths,
        glob=None,
        limit=None,
        max_doc_bytes=MAX_DOC_BYTES,
        text_key: str = "text",
        id_key: str = "id",
    ):
        super().__init__(paths, glob, limit, max_doc_bytes)
        self.text_key, self.id_key = text_key, id_key

    def read(self, path: Path, source: str, stats: StepStats) -> Iterator[Document]:
        for n, line in _lines(_chunks(path), self.max_doc_bytes):
            if line is None:
                _drop(stats, source, n, "too_long", 0, {"line": n})
                continue
            if not line.strip():
                continue
            decoded = _decode(line, stats)
            try:
                obj = json.loads(decoded)
            except json.JSONDecodeError as e:
                meta = {"line": n, "error": e.msg}
                _drop(stats, source, n, "bad_json", len(line), meta, decoded)
                continue
            doc = _record_document(obj, source, n, self.text_key, self.id_key, stats)
            if isinstance(doc, str):  # the line as it was, so the exclusion shows what was wrong
                _drop(stats, source, n, doc, len(line), {"line": n}, decoded)
            else:
                yield _emit(stats, doc, len(line), len(doc.text.encode("utf-8", "surrogatepass")))


# ---- Parquet -----------------------------------------------------------------------------------------------


@register_step("read_parquet")
class ParquetReader(Reader):
    """One document per row: column ``text_key`` is the text, ``id_key`` the id when present, a ``metadata``
    column (JSON string or struct) and every other column become metadata. Read a row group at a time."""

    suffixes = (".parquet",)
    config_ignore = ("batch_size",)  # rows read at a time: the documents are the same

    def __init__(
        self,
        paths,
        glob=None,
        limit=None,
        max_doc_bytes=MAX_DOC_BYTES,
        text_key: str = "text",
        id_key: str = "id",
        batch_size: int = 1024,
    ):
        super().__init__(paths, glob, limit, max_doc_bytes)
        self.text_key, self.id_key, self.batch_size = text_key, id_key, batch_size

    def read(self, path: Path, source: str, stats: StepStats) -> Iterator[Document]:
        import pyarrow.parquet as pq

        row = 0
        with pq.ParquetFile(path) as f:
            for batch in f.iter_batches(batch_size=self.batch_size):
                for obj in batch.to_pylist():
                    text = obj.get(self.text_key)
                    nbytes = (
                        len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0
                    )
                    if nbytes > self.max_doc_bytes:
                        _drop(stats, source, row, "too_long", nbytes, {"row": row})
                    else:
                        doc = _record_document(obj, source, row, self.text_key, self.id_key, stats)
                        if isinstance(doc, str):
                            _drop(stats, source, row, doc, nbytes, {"row": row})
                        else:
                            yield _emit(stats, doc, nbytes, nbytes)
                    row += 1


# ---- text files --------------------------------------------------------------------------------------------


@register_step("read_text")
class TextReader(Reader):
    """One document per file (every file of a folder unless ``glob`` or ``suffixes`` narrow it)."""

    def __init__(
        self,
        paths,
        glob=None,
        limit=None,
        max_doc_bytes=MAX_DOC_BYTES,
        suffixes: tuple[str, ...] | list[str] = (),
    ):
        super().__init__(paths, glob, limit, max_doc_bytes)
        self.suffixes = tuple(suffixes)

    def read(self, path: Path, source: str, stats: StepStats) -> Iterator[Document]:
        size = path.stat().st_size
        if size > self.max_doc_bytes:
            _drop(stats, source, 0, "too_long", size)
            return
        data = path.read_bytes()
        text = _decode(data, stats)
        if not text.strip():
            _drop(stats, source, 0, "empty", len(data))
            return
        yield _emit(
            stats,
            Document(text, stable_id(source, 0), {"source": source}),
            len(data),
            len(text.encode("utf-8", "surrogatepass")),
        )


# ---- WARC and WET ------------------------------------------------------------------------------------------


def _http_split(block: bytes) -> tuple[int | None, dict[str, str], bytes] | None:
    """(status, headers lower-cased, body) of an HTTP response block; None without a header/body separator."""
    end = block.find(b"\r\n\r\n")
    sep = 4
    if end < 0:
        end, sep = block.find(b"\n\n"), 2
        if end < 0:
            return None
    head = block[:end].decode("latin-1").splitlines()
    status = None
    if head and head[0].startswith("HTTP/"):
        fields = head[0].split()
        status = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    headers: dict[str, str] = {}
    for line in head[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, block[end + sep :]


def _dechunk(body: bytes) -> bytes:
    """The payload of a ``Transfer-Encoding: chunked`` body (RFC 9112 §7.1); ValueError when malformed."""
    out, i = [], 0
    while True:
        nl = body.find(b"\r\n", i)
        if nl < 0:
            raise ValueError("chunk size line without CRLF")
        size = int(body[i:nl].split(b";")[0].strip(), 16)
        if size == 0:
            return b"".join(out)
        out.append(body[nl + 2 : nl + 2 + size])
        if len(out[-1]) < size:
            raise ValueError("chunk shorter than its size")
        i = nl + 2 + size + 2


def _decode_payload(headers: dict[str, str], body: bytes, stats: StepStats) -> bytes:
    """Undo chunked transfer and gzip/deflate content encodings (crawlers such as wget store bodies as
    received; Common Crawl stores them decoded). A body that does not decode is kept as it is, counted."""
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = _dechunk(body)
        enc = headers.get("content-encoding", "").lower().strip()
        if enc in ("gzip", "x-gzip"):
            body = zlib.decompress(body, wbits=47)  # gzip or zlib header
        elif enc == "deflate":
            try:
                body = zlib.decompress(body)
            except zlib.error:
                body = zlib.decompress(body, wbits=-15)  # raw deflate, as some servers send
    except (ValueError, zlib.error):
        stats.counters["undecodable_http_encoding"] += 1
    return body


class _WarcBase(Reader):
    record_type = "response"

    def _records(self, path: Path):
        from fastwarc.warc import ArchiveIterator, WarcRecordType

        types = getattr(WarcRecordType, self.record_type)
        return ArchiveIterator(str(path), record_types=types, parse_http=False, fsspec_args=False)

    def read(self, path: Path, source: str, stats: StepStats) -> Iterator[Document]:
        for record in self._records(path):
            rid = record.record_id or f"offset:{record.stream_pos}"
            declared = record.content_length
            meta = {
                "source": source,
                "url": record.headers.get("WARC-Target-URI", ""),
                "warc_date": record.headers.get("WARC-Date", ""),
                "warc_record_id": rid,
            }
            if declared > self.max_doc_bytes:
                _drop(stats, source, rid, "too_long", declared, meta)
                continue
            block = record.reader.read()
            if len(block) < declared:
                _drop(stats, source, rid, "truncated_record", len(block), meta)
                continue
            doc = self.document(block, source, rid, meta, record, stats)
            if isinstance(doc, str):
                _drop(stats, source, rid, doc, len(block), meta)
            else:
                yield doc

    def document(self, block, source, rid, meta, record, stats) -> Document | str:
        raise NotImplementedError


@register_step("read_warc")
class WarcReader(_WarcBase):
    """WARC ``response`` records (.warc, .warc.gz, .warc.zst): the HTTP body in ``metadata["raw"]`` (bytes),
    ``text`` empty until :mod:`lmstack.data.extract` fills it (see the module docstring)."""

    suffixes = (".warc", ".warc.gz", ".warc.zst", ".warc.lz4")

    def document(self, block, source, rid, meta, record, stats):
        http = _http_split(block)
        if http is None or not http[2]:
            return "no_http_body"
        status, headers, body = http
        body = _decode_payload(headers, body, stats)
        doc = Document(
            "",
            stable_id(source, rid),
            {
                **meta,
                "content_type": headers.get("content-type", ""),
                "http_status": status,
                "raw": body,
            },
        )
        return _emit(stats, doc, len(block), len(body))


@register_step("read_wet")
class WetReader(_WarcBase):
    """WET ``conversion`` records: the extracted plain text Common Crawl ships (UTF-8, replaced when not)."""

    suffixes = (".wet", ".wet.gz", ".warc.wet.gz", ".wet.zst")
    record_type = "conversion"

    def document(self, block, source, rid, meta, record, stats):
        text = _decode(block, stats)
        if not text.strip():
            return "empty"
        meta = {
            **meta,
            "content_type": record.headers.get("Content-Type", "text/plain"),
            "refers_to": record.headers.get("WARC-Refers-To", ""),
        }
        lang = record.headers.get("WARC-Identified-Content-Language")
        if lang:
            meta["cc_languages"] = lang
        return _emit(
            stats,
            Document(text, stable_id(source, rid), meta),
            len(block),
            len(text.encode("utf-8", "surrogatepass")),
        )
