"""``lmstack data demo``'s filter half: build the labelled offline crawl (:mod:`lmstack.data.corpus`), run the
extraction and every filter over it, and report each filter's precision and recall against the labels.

Each filter is scored on its own, on the documents it would see in the pipeline's order: language id on
everything extraction kept; the quality, classifier and PII steps on the pages labelled English. Truth:
``quality == "bad"`` for the heuristic quality filters (so one filter's recall counts only the bad pages it
catches: each rule targets some kinds; ``caught`` lists them), ``language != "en"`` for the language filter,
the ``nsfw``/``toxic`` labels for the classifiers, the known PII counts of generated pages for PII.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmstack.data.document import Document, stable_id
from lmstack.data.step import Filter, StepStats
from lmstack.utils import atomic_write_text


def read_warc(path: str | Path) -> Iterator[Document]:
    """WARC response records -> documents with the payload in ``metadata["raw"]`` (the readers' contract)."""
    from warcio.archiveiterator import ArchiveIterator

    with open(path, "rb") as fh:
        for rec in ArchiveIterator(fh):
            if rec.rec_type != "response":
                continue
            rid = rec.rec_headers.get_header("WARC-Record-ID")
            ctype = rec.http_headers.get_header("Content-Type") if rec.http_headers else None
            yield Document("", stable_id(str(path), rid), {"url": rec.rec_headers.get_header("WARC-Target-URI"),
                                                           "raw": rec.content_stream().read(),
                                                           "content_type": ctype or ""})


def _filters() -> dict[str, Filter]:
    from lmstack.data.classifiers import NSFWFilter, ToxicFilter
    from lmstack.data.langid import LanguageFilter
    from lmstack.data.quality import C4Quality, FineWebQuality, GopherQuality, GopherRepetition

    return {"language_filter": LanguageFilter("en"), "gopher_quality": GopherQuality(),
            "gopher_repetition": GopherRepetition(), "c4_quality": C4Quality(), "fineweb_quality": FineWebQuality(),
            "nsfw_filter": NSFWFilter(), "toxic_filter": ToxicFilter()}


def _pr(tp: int, fp: int, fn: int) -> tuple[float, float]:
    return (tp / (tp + fp) if tp + fp else 1.0), (tp / (tp + fn) if tp + fn else 1.0)


def evaluate(docs: list[Document], labels: dict[str, dict[str, Any]], dropped_by_extract: dict[str, str]) -> dict:
    """Precision/recall of every filter (see the module docstring) on extracted ``docs``."""
    from lmstack.data.pii import PII

    rows: dict[str, dict[str, Any]] = {}
    binary = {u for u, lab in labels.items() if lab["kind"] == "binary"}
    ex_drop = set(dropped_by_extract)
    bad = {u for u, lab in labels.items() if lab["quality"] == "bad"}
    p, r = _pr(len(ex_drop & bad), len(ex_drop - bad), len(binary - ex_drop))  # recall: of the binary records
    rows["extract (binary records)"] = {"flagged": len(ex_drop), "precision": p, "recall": r, "real_dropped": 0,
                                       "caught": dict(Counter(labels[u]["kind"] for u in ex_drop))}
    filters = _filters()
    english = [d for d in docs if labels[d.metadata["url"]]["language"] == "en"]
    for name, flt in filters.items():
        pool = docs if name == "language_filter" else english
        truth = {"language_filter": lambda lab: lab["language"] != "en",
                 "nsfw_filter": lambda lab: lab["nsfw"], "toxic_filter": lambda lab: lab["toxic"]}.get(
            name, lambda lab: lab["quality"] == "bad")
        flagged = Counter()
        t = f = n = real = 0
        for d in pool:
            lab = labels[d.metadata["url"]]
            why = flt.reason(copy.deepcopy(d))
            if why is not None:
                flagged[lab["kind"]] += 1
            if lab["kind"] == "real" and name != "language_filter":  # no quality truth for real pages
                real += why is not None
                continue
            bad = truth(lab)
            t += why is not None and bad
            f += why is not None and not bad
            n += why is None and bad
        p, r = _pr(t, f, n)
        rows[name] = {"flagged": t + f, "precision": p, "recall": r, "caught": dict(flagged), "real_dropped": real}
    # PII: exact counts on the generated pages; replacements on real pages are reported, not scored
    pii = PII()
    t = f = n = real = 0
    for d in english:
        lab = labels[d.metadata["url"]]
        out = pii.apply(d, StepStats("pii")).metadata.get("pii", {})
        if lab["kind"] == "real":
            real += sum(out.values())
            continue
        for k, true in lab["pii"].items():
            got = out.get(k, 0)
            t, f, n = t + min(got, true), f + max(0, got - true), n + max(0, true - got)
    p, r = _pr(t, f, n)
    rows["pii (replacements)"] = {"flagged": t + f, "precision": p, "recall": r, "caught": {},
                                  "real_dropped": 0, "replacements_on_real_pages": real}
    # decoding: the check sentence of every wrongly-encoded page must come out intact
    enc = [d for d in docs if labels[d.metadata["url"]]["kind"] == "wrong_encoding"]
    ok = sum(labels[d.metadata["url"]]["check"] in d.text for d in enc)
    rows["extract (wrong encodings decoded)"] = {"flagged": len(enc), "precision": ok / max(1, len(enc)),
                                                 "recall": ok / max(1, len(enc)), "caught": {}, "real_dropped": 0}
    # boilerplate: lines of menus/footers left in the article pages' text, article paragraphs kept
    boil = [d for d in docs if labels[d.metadata["url"]]["kind"] == "boilerplate_heavy"]
    kept_lines = bad_lines = art = art_kept = 0
    for d in boil:
        paras = labels[d.metadata["url"]]["article"]
        lines = d.text.splitlines()
        kept_lines += len(lines)
        bad_lines += sum(1 for ln in lines if not any(ln in p or p in ln for p in paras) and not ln.startswith("Story"))
        art += len(paras)
        art_kept += sum(p in d.text for p in paras)
    rows["extract (main content)"] = {"flagged": kept_lines, "precision": 1 - bad_lines / max(1, kept_lines),
                                      "recall": art_kept / max(1, art), "caught": {}, "real_dropped": 0}
    return rows


def run_demo(out_dir: str | Path, real_limit: int = 120, n_files: int = 4, quiet: bool = False) -> dict[str, Any]:
    """Builds the crawl in ``out_dir/crawl``, runs extraction and the filters, prints and writes
    ``out_dir/filters_report.json`` (per filter: flagged, precision, recall, kinds caught) and the funnel."""
    from lmstack.data.classifiers import NSFWFilter, ToxicFilter
    from lmstack.data.corpus import read_labels, write_corpus
    from lmstack.data.extract import Extract
    from lmstack.data.langid import LanguageFilter
    from lmstack.data.pii import PII
    from lmstack.data.quality import C4Quality, FineWebQuality, GopherQuality, GopherRepetition

    out = Path(out_dir)
    t0 = time.perf_counter()
    summary = write_corpus(out / "crawl", n_files=n_files, real_limit=real_limit)
    labels = read_labels(out / "crawl")
    raw = [d for f in sorted((out / "crawl").glob("*.warc.gz")) for d in read_warc(f)]
    ex_stats = StepStats("extract")
    dropped: dict[str, str] = {}
    ex_stats.on_drop = lambda doc, step, why: dropped.__setitem__(doc.metadata["url"], why)
    docs = list(Extract()(raw, ex_stats))
    rows = evaluate(docs, labels, dropped)
    # the whole chain, in pipeline order: the funnel
    chain = [LanguageFilter("en"), GopherQuality(), GopherRepetition(), C4Quality(), FineWebQuality(), PII(),
             NSFWFilter(), ToxicFilter()]
    funnel = [{"step": "read", "docs": len(raw)}, {"step": "extract", "docs": len(docs),
                                                   "dropped": dict(ex_stats.dropped)}]
    stream: list[Document] = [copy.deepcopy(d) for d in docs]
    for step in chain:
        st = StepStats(step.name)
        stream = list(step(stream, st))
        funnel.append({"step": step.name, "docs": len(stream), "dropped": dict(st.dropped),
                       "counters": dict(st.counters)})
    kinds_left = dict(Counter(labels[d.metadata["url"]]["kind"] for d in stream))
    left = {d.metadata["url"] for d in stream}
    gen = {u: lab for u, lab in labels.items() if lab["kind"] != "real"}
    unwanted = {u for u, lab in gen.items() if lab["quality"] == "bad" or lab["nsfw"] or lab["toxic"]}
    chain_row = {"unwanted_generated_removed": len(unwanted - left) / max(1, len(unwanted)),
                 "wanted_generated_kept": len((set(gen) - unwanted) & left) / max(1, len(set(gen) - unwanted)),
                 "real_pages_kept": sum(1 for u in left if labels[u]["kind"] == "real")}
    report = {"corpus": summary, "filters": rows, "funnel": funnel, "survivors_by_kind": kinds_left,
              "chain": chain_row, "seconds": round(time.perf_counter() - t0, 1)}
    atomic_write_text(out / "filters_report.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
    if not quiet:
        print(f"corpus: {summary['records']} records in {summary['files']} WARC files: {summary['kinds']}")
        n_real = sum(lab["kind"] == "real" for lab in labels.values())
        print(f"{'filter':34s} {'flagged':>7s} {'precision':>9s} {'recall':>6s} {'real pages dropped':>18s}  caught")
        for name, r in rows.items():
            print(f"{name:34s} {r['flagged']:7d} {r['precision']:9.3f} {r['recall']:6.3f} "
                  f"{r['real_dropped']:>10d} of {n_real:<5d}  {r['caught']}")
        print("funnel: " + " -> ".join(f"{f['step']} {f['docs']}" for f in funnel))
        print(f"survivors by kind: {kinds_left}")
        print(f"whole chain: {chain_row['unwanted_generated_removed']:.1%} of the unwanted generated pages removed, "
              f"{chain_row['wanted_generated_kept']:.1%} of the wanted ones kept, "
              f"{chain_row['real_pages_kept']} real pages kept ({report['seconds']} s)")
    return report
