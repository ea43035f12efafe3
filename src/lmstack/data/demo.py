"""``lmstack data demo``: build the labelled offline crawl (:mod:`lmstack.data.corpus`), run the whole pipeline
over it on an executor (read WARC -> extract -> language -> quality rules -> PII -> NSFW/toxic -> exact and
MinHash dedup -> tokenize), print the funnel (the ``lmstack data stats`` table and PNG) and the precision and
recall of every step against the labels.

The pipeline is written to ``out/pipeline.toml`` (``lmstack data run`` runs it again, locally or on Ray). Its
stages: ``filter`` (one task per WARC file: read, extract, a writer of the extracted text, the filters, PII,
the first stages of both dedups, a writer), ``exact_duplicates``, ``minhash_buckets``, ``minhash_confirm``,
``minhash_clusters`` (global), ``dedup`` (the two dedup filters over the written shards, a writer) and
``tokenize`` (a byte-level BPE trained by the demo on the clean text, then the token files).

Precision and recall, two ways. *In the pipeline*: each step scored on the documents that reached it, from
the exclusions (every dropped document with its step and reason). *Alone* (:func:`evaluate`): each filter
scored on its own on what it would see first: language id on
everything extraction kept; the quality, classifier and PII steps on the pages labelled English. Truth:
``quality == "bad"`` for the heuristic quality filters (so one filter's recall counts only the bad pages it
catches: each rule targets some kinds; ``caught`` lists them), ``language != "en"`` for the language filter,
the ``nsfw``/``toxic`` labels for the classifiers, the known PII counts of generated pages for PII; for the
dedup filters, the planted groups (a clean page with its exact copies, and its near copies at Jaccard >= the
MinHash threshold): all but one member of each group present should go.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmstack.data.document import Document
from lmstack.data.step import Filter, StepStats
from lmstack.utils import atomic_write_text

SEP = "<|endoftext|>"  # the EOS between documents in the token files (as `lmstack demo`'s)
CHAIN = (
    "language_filter",
    "gopher_quality",
    "gopher_repetition",
    "c4_quality",
    "fineweb_quality",
    "code_quality",
    "pii",
    "nsfw_filter",
    "toxic_filter",
)


def _filters() -> dict[str, Filter]:
    from lmstack.data.classifiers import NSFWFilter, ToxicFilter
    from lmstack.data.langid import LanguageFilter
    from lmstack.data.quality import C4Quality, FineWebQuality, GopherQuality, GopherRepetition
    from lmstack.data.route import CodeQuality

    out: dict[str, Filter] = {
        "language_filter": LanguageFilter("en"),
        "gopher_quality": GopherQuality(),
        "gopher_repetition": GopherRepetition(),
        "c4_quality": C4Quality(),
        "fineweb_quality": FineWebQuality(),
        "code_quality": CodeQuality(),
        "nsfw_filter": NSFWFilter(),
        "toxic_filter": ToxicFilter(),
    }
    for name in (
        "gopher_quality",
        "gopher_repetition",
        "c4_quality",
        "fineweb_quality",
    ):  # demo_stages
        out[name].routes = ("prose",)
    out["code_quality"].routes = ("code",)
    return out


def _pr(tp: int, fp: int, fn: int) -> tuple[float, float]:
    return (tp / (tp + fp) if tp + fp else 1.0), (tp / (tp + fn) if tp + fn else 1.0)


def evaluate(
    docs: list[Document], labels: dict[str, dict[str, Any]], dropped_by_extract: dict[str, str]
) -> dict:
    """Precision/recall of every filter (see the module docstring) on extracted ``docs``."""
    from lmstack.data.pii import PII

    rows: dict[str, dict[str, Any]] = {}
    binary = {u for u, lab in labels.items() if lab["kind"] == "binary"}
    ex_drop = set(dropped_by_extract)
    bad = {u for u, lab in labels.items() if lab["quality"] == "bad"}
    p, r = _pr(
        len(ex_drop & bad), len(ex_drop - bad), len(binary - ex_drop)
    )  # recall: of the binary records
    rows["extract (binary records)"] = {
        "flagged": len(ex_drop),
        "precision": p,
        "recall": r,
        "real_dropped": 0,
        "caught": dict(Counter(labels[u]["kind"] for u in ex_drop)),
    }
    from lmstack.data.route import CodeRouter

    filters = _filters()
    english = [d for d in docs if labels[d.metadata["url"]]["language"] == "en"]
    router = CodeRouter()
    route = {d.metadata["url"]: router.route(d.text)[0] for d in english}
    code = Counter(labels[u]["kind"] for u, r in route.items() if r == "code")
    n_real = sum(labels[u]["kind"] == "real" for u in route)
    rows["code_router (to the code rules)"] = {  # truth: the real documentation pages
        "flagged": sum(code.values()),
        "precision": code["real"] / max(1, sum(code.values())),
        "recall": code["real"] / max(1, n_real),
        "real_dropped": 0,
        "caught": dict(code),
    }
    for name, flt in filters.items():
        pool = docs if name == "language_filter" else english
        if flt.routes is not None:  # a routed filter sees only its routes' documents
            pool = [d for d in pool if route[d.metadata["url"]] in flt.routes]
        truth = {
            "language_filter": lambda lab: lab["language"] != "en",
            "nsfw_filter": lambda lab: lab["nsfw"],
            "toxic_filter": lambda lab: lab["toxic"],
        }.get(name, lambda lab: lab["quality"] == "bad")
        flagged = Counter()
        t = f = n = real = 0
        for d in pool:
            lab = labels[d.metadata["url"]]
            why = flt.reason(copy.deepcopy(d))
            if why is not None:
                flagged[lab["kind"]] += 1
            if (
                lab["kind"] == "real" and name != "language_filter"
            ):  # no quality truth for real pages
                real += why is not None
                continue
            bad = truth(lab)
            t += why is not None and bad
            f += why is not None and not bad
            n += why is None and bad
        p, r = _pr(t, f, n)
        rows[name] = {
            "flagged": t + f,
            "precision": p,
            "recall": r,
            "caught": dict(flagged),
            "real_dropped": real,
        }
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
    rows["pii (replacements)"] = {
        "flagged": t + f,
        "precision": p,
        "recall": r,
        "caught": {},
        "real_dropped": 0,
        "replacements_on_real_pages": real,
    }
    # decoding: the check sentence of every wrongly-encoded page must come out intact
    enc = [d for d in docs if labels[d.metadata["url"]]["kind"] == "wrong_encoding"]
    ok = sum(labels[d.metadata["url"]]["check"] in d.text for d in enc)
    rows["extract (wrong encodings decoded)"] = {
        "flagged": len(enc),
        "precision": ok / max(1, len(enc)),
        "recall": ok / max(1, len(enc)),
        "caught": {},
        "real_dropped": 0,
    }
    # boilerplate: lines of menus/footers left in the article pages' text, article paragraphs kept
    boil = [d for d in docs if labels[d.metadata["url"]]["kind"] == "boilerplate_heavy"]
    kept_lines = bad_lines = art = art_kept = 0
    for d in boil:
        paras = labels[d.metadata["url"]]["article"]
        lines = d.text.splitlines()
        kept_lines += len(lines)
        bad_lines += sum(
            1
            for ln in lines
            if not any(ln in p or p in ln for p in paras) and not ln.startswith("Story")
        )
        art += len(paras)
        art_kept += sum(p in d.text for p in paras)
    rows["extract (main content)"] = {
        "flagged": kept_lines,
        "precision": 1 - bad_lines / max(1, kept_lines),
        "recall": art_kept / max(1, art),
        "caught": {},
        "real_dropped": 0,
    }
    return rows


# ---- the pipeline -----------------------------------------------------------------------------------------


def demo_stages(
    out: Path, bucket_tasks: int = 2, confirm_tasks: int = 2, threshold: float = 0.8
) -> list[dict]:
    """The demo's ``[[stage]]`` tables (dicts for :meth:`Pipeline.from_dict`), without the tokenize stage."""
    s = lambda p: str(out / p)
    filt = [
        {"type": "read_warc", "paths": [s("crawl")]},
        {"type": "extract"},
        {"type": "write_jsonl", "name": "write_extracted", "output": s("extracted")},
        {"type": "language_filter", "languages": ["en"], "threshold": 0.65},
        {"type": "code_router"},  # documentation with code takes the code rules, not the prose ones
        {"type": "gopher_quality", "routes": ["prose"]},
        {"type": "gopher_repetition", "routes": ["prose"]},
        {"type": "c4_quality", "routes": ["prose"]},
        {"type": "fineweb_quality", "routes": ["prose"]},
        {"type": "code_quality", "routes": ["code"]},
        {"type": "pii"},
        {"type": "nsfw_filter"},
        {"type": "toxic_filter"},
        {"type": "exact_hashes"},
        {"type": "minhash_signatures", "threshold": threshold},
        {"type": "write_jsonl", "name": "write_filtered", "output": s("filtered")},
    ]
    return [
        {"name": "filter", "step": filt},
        {"name": "exact_duplicates", "tasks": 1, "step": [{"type": "exact_duplicates"}]},
        {"name": "minhash_buckets", "tasks": bucket_tasks, "step": [{"type": "minhash_buckets"}]},
        {"name": "minhash_confirm", "tasks": confirm_tasks, "step": [{"type": "minhash_confirm"}]},
        {"name": "minhash_clusters", "tasks": 1, "step": [{"type": "minhash_clusters"}]},
        {
            "name": "dedup",
            "step": [
                {"type": "read_jsonl", "paths": [s("filtered")]},
                {"type": "exact_filter"},
                {"type": "minhash_filter"},
                {"type": "write_jsonl", "name": "write_clean", "output": s("clean")},
            ],
        },
    ]


def tokenize_stage(out: Path) -> dict:
    return {
        "name": "tokenize",
        "step": [
            {"type": "read_jsonl", "paths": [str(out / "clean")]},
            {
                "type": "tokenize",
                "tokenizer": str(out / "tokenizer.json"),
                "output": str(out / "tokens"),
            },
        ],
    }


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def to_toml(pipeline: dict[str, Any]) -> str:
    """A pipeline dict (``output``, ``stage`` tables of ``step`` tables) as the TOML ``lmstack data run`` reads."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in pipeline.items() if k != "stage"]
    for st in pipeline["stage"]:
        lines += ["", "[[stage]]"] + [
            f"{k} = {_toml_value(v)}" for k, v in st.items() if k != "step"
        ]
        for step in st["step"]:
            lines += ["[[stage.step]]"] + [f"{k} = {_toml_value(v)}" for k, v in step.items()]
    return "\n".join(lines) + "\n"


def _records(folder: Path) -> Iterator[dict[str, Any]]:
    from lmstack.data.writers import read_records

    for f in sorted(folder.glob("*.jsonl*")):
        yield from read_records(f)


def _excluded(logs: Path, stage: str) -> list[dict[str, Any]]:
    return list(_records(logs / stage / "excluded"))


def train_tokenizer(clean: Path, path: Path, vocab_size: int) -> None:
    """A byte-level BPE (gpt2 pattern, ``<|endoftext|>`` as EOS) trained on the clean documents' text."""
    import tempfile

    from lmstack.tokenizer import Tokenizer, save, train_bpe

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "clean.txt"
        with open(text, "w", encoding="utf-8") as f:
            for r in _records(clean):
                f.write(r["text"] + "\n\n")
        vocab, merges = train_bpe(text, vocab_size, [SEP], "gpt2", progress=False)
    tok = Tokenizer(vocab, merges, [SEP], pattern="gpt2")
    tok.eos_token_id = tok.special_tokens[SEP]
    save(tok, path)


def _dedup_pr(
    present: set[str], dropped: set[str], groups: list[set[str]]
) -> tuple[int, float, float]:
    """(flagged, precision, recall): every member but one of each group present should be dropped."""
    tp = expected = 0
    for g in groups:
        should = max(0, len(g & present) - 1)
        expected += should
        tp += min(len(g & dropped), should)
    p, r = _pr(tp, len(dropped) - tp, expected - tp)
    return len(dropped), p, r


def pipeline_rows(
    labels: dict[str, dict[str, Any]],
    logs: Path,
    extracted: set[str],
    filtered: set[str],
    threshold: float,
) -> dict[str, dict[str, Any]]:
    """Each filter and dedup step scored on the documents that reached it in the pipeline (from the exclusions)."""
    drop_at: dict[str, str] = {}
    for r in _excluded(logs, "filter"):
        drop_at.setdefault(r["metadata"].get("url", ""), r["step"])
    rows: dict[str, dict[str, Any]] = {}
    reached = set(extracted)
    truth = {
        "language_filter": lambda lab: lab["language"] != "en",
        "nsfw_filter": lambda lab: lab["nsfw"],
        "toxic_filter": lambda lab: lab["toxic"],
    }
    for name in CHAIN:
        if name == "pii":
            continue
        is_bad = truth.get(
            name, lambda lab: lab["quality"] == "bad"
        )  # each step's own truth, as evaluate's
        flagged = {u for u in reached if drop_at.get(u) == name}
        scored = {u for u in reached if name == "language_filter" or labels[u]["kind"] != "real"}
        bad = {u for u in scored if is_bad(labels[u])}
        p, r = _pr(len(flagged & bad), len((flagged & scored) - bad), len(bad - flagged))
        rows[name] = {
            "docs_in": len(reached),
            "flagged": len(flagged),
            "precision": p,
            "recall": r,
            "real_dropped": sum(labels[u]["kind"] == "real" for u in flagged),
            "caught": dict(Counter(labels[u]["kind"] for u in flagged)),
        }
        reached -= flagged
    groups: dict[str, dict[str, set[str]]] = {}
    for (
        u,
        lab,
    ) in (
        labels.items()
    ):  # exact: planted copies and real pages with the same bytes as an earlier one
        exact = lab["kind"] == "exact_duplicate" or (lab["kind"] == "real" and "dup_of" in lab)
        if exact or (lab["kind"] == "near_duplicate" and lab["jaccard"] >= threshold):
            g = groups.setdefault(lab["dup_of"], {"exact": {lab["dup_of"]}, "all": {lab["dup_of"]}})
            g["all"].add(u)
            if exact:
                g["exact"].add(u)
    dedup = {r["metadata"].get("url", ""): r["step"] for r in _excluded(logs, "dedup")}
    present = set(filtered)
    for name, key in (("exact_filter", "exact"), ("minhash_filter", "all")):
        dropped = {u for u in present if dedup.get(u) == name}
        n, p, r = _dedup_pr(present, dropped, [g[key] for g in groups.values()])
        rows[name] = {
            "docs_in": len(present),
            "flagged": n,
            "precision": p,
            "recall": r,
            "real_dropped": sum(labels[u]["kind"] == "real" for u in dropped),
            "caught": dict(Counter(labels[u]["kind"] for u in dropped)),
        }
        present -= dropped
    return rows


def run_demo(
    out_dir: str | Path,
    real_limit: int = 120,
    n_files: int = 4,
    quiet: bool = False,
    workers: int = 2,
    executor: str = "local",
    tiny: bool = False,
    vocab_size: int = 2048,
    **executor_kw: Any,
) -> dict[str, Any]:
    """Builds the crawl in ``out_dir/crawl``, runs the demo pipeline (``out_dir/pipeline.toml``, logs in
    ``out_dir/pipeline``) on ``executor`` with ``workers``, prints the funnel and every step's precision and
    recall, writes ``out_dir/filters_report.json`` and ``out_dir/funnel.png``. ``tiny``: a small crawl (16 clean
    pages, no very long ones, at most 8 real pages) for tests. A relaunch skips the completed tasks."""
    from lmstack.data.corpus import read_labels, write_corpus
    from lmstack.data.executor import get_executor
    from lmstack.data.pipeline import Pipeline
    from lmstack.data.report import format_table, merge_stats, plot_funnel, to_json

    out = Path(out_dir).resolve()
    t0 = time.perf_counter()
    size = {"n_clean": 16, "long_pages": 0} if tiny else {}
    summary = write_corpus(
        out / "crawl",
        n_files=n_files,
        real_limit=min(real_limit, 8) if tiny else real_limit,
        **size,
    )
    labels = read_labels(out / "crawl")
    logs = out / "pipeline"
    threshold = 0.8
    stages = demo_stages(out, threshold=threshold)
    run = get_executor(executor, workers, progress=not quiet, **executor_kw).run
    run(Pipeline.from_dict({"output": str(logs), "stage": stages}))  # every stage but tokenize
    if not (out / "tokenizer.json").is_file():
        train_tokenizer(out / "clean", out / "tokenizer.json", vocab_size)
    spec = {"output": str(logs), "stage": stages + [tokenize_stage(out)]}
    atomic_write_text(
        out / "pipeline.toml",
        "# lmstack data demo's pipeline: lmstack data run pipeline.toml\n" + to_toml(spec),
    )
    run(
        Pipeline.from_toml(out / "pipeline.toml")
    )  # the stages above are complete: only tokenize runs
    merged = merge_stats(logs)
    atomic_write_text(logs / "stats.json", json.dumps(to_json(merged), indent=1) + "\n")
    png = plot_funnel(merged, out / "funnel.png")

    docs = [Document(r["text"], r["id"], r["metadata"]) for r in _records(out / "extracted")]
    dropped = {
        r["metadata"].get("url", ""): r["reason"]
        for r in _excluded(logs, "filter")
        if r["step"] == "extract"
    }
    rows = evaluate(docs, labels, dropped)
    filtered = {r["metadata"]["url"] for r in _records(out / "filtered")}
    in_pipeline = pipeline_rows(
        labels, logs, {d.metadata["url"] for d in docs}, filtered, threshold
    )
    funnel = [
        {
            "stage": st,
            "step": s.name,
            "docs": s.docs_out,
            "bytes": s.bytes_out,
            "dropped": dict(s.dropped),
            "counters": dict(s.counters),
        }
        for st, m in merged.items()
        for s in m["steps"]
        if s.docs_in or s.docs_out
    ]
    funnel.insert(
        0,
        {
            "stage": "filter",
            "step": "input",
            "docs": merged["filter"]["steps"][0].docs_in,
            "bytes": merged["filter"]["steps"][0].bytes_in,
        },
    )
    left = {r["metadata"]["url"] for r in _records(out / "clean")}
    kinds_left = dict(Counter(labels[u]["kind"] for u in left))
    gen = {u: lab for u, lab in labels.items() if lab["kind"] != "real"}
    unwanted = {
        u for u, lab in gen.items() if lab["quality"] == "bad" or lab["nsfw"] or lab["toxic"]
    }
    groups: dict[str, set[str]] = {}  # a clean page with its exact copies and near copies at J >= τ
    for u, lab in gen.items():
        if lab["kind"] == "exact_duplicate" or (
            lab["kind"] == "near_duplicate" and lab["jaccard"] >= threshold
        ):
            groups.setdefault(lab["dup_of"], {lab["dup_of"]}).add(u)
    grouped = set().union(*groups.values()) if groups else set()
    units = [{u} for u in set(gen) - unwanted - grouped] + list(groups.values())  # keep one of each
    tokens = merged["tokenize"]["steps"][-1].counters.get("tokens", 0)
    chain_row = {
        "unwanted_generated_removed": len(unwanted - left) / max(1, len(unwanted)),
        "duplicate_groups_left_with_one": sum(len(g & left) == 1 for g in groups.values()),
        "duplicate_groups": len(groups),
        "wanted_generated_kept": sum(bool(g & left) for g in units) / max(1, len(units)),
        "real_pages_kept": sum(1 for u in left if labels[u]["kind"] == "real"),
        "tokens": tokens,
    }
    report = {
        "corpus": summary,
        "filters": rows,
        "pipeline": in_pipeline,
        "funnel": funnel,
        "survivors_by_kind": kinds_left,
        "chain": chain_row,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    atomic_write_text(
        out / "filters_report.json", json.dumps(report, indent=2, sort_keys=True) + "\n"
    )
    if not quiet:
        n_real = sum(lab["kind"] == "real" for lab in labels.values())
        print(
            f"corpus: {summary['records']} records in {summary['files']} WARC files: {summary['kinds']}"
        )
        print(format_table(merged))
        print(f"funnel -> {png}; pipeline -> {out / 'pipeline.toml'}")
        print("\nin the pipeline (each step on the documents that reached it):")
        print(
            f"{'step':18s} {'docs in':>7s} {'dropped':>7s} {'precision':>9s} {'recall':>6s} {'real dropped':>12s}  caught"
        )
        for name, r in in_pipeline.items():
            print(
                f"{name:18s} {r['docs_in']:7d} {r['flagged']:7d} {r['precision']:9.3f} {r['recall']:6.3f} "
                f"{r['real_dropped']:12d}  {r['caught']}"
            )
        print("\nalone (each filter on everything it could see):")
        print(
            f"{'filter':34s} {'flagged':>7s} {'precision':>9s} {'recall':>6s} {'real pages dropped':>18s}  caught"
        )
        for name, r in rows.items():
            print(
                f"{name:34s} {r['flagged']:7d} {r['precision']:9.3f} {r['recall']:6.3f} "
                f"{r['real_dropped']:>10d} of {n_real:<5d}  {r['caught']}"
            )
        print(f"survivors by kind: {kinds_left}")
        print(
            f"whole pipeline: {chain_row['unwanted_generated_removed']:.1%} of the unwanted generated pages removed, "
            f"{chain_row['duplicate_groups_left_with_one']} of {chain_row['duplicate_groups']} planted duplicate "
            f"groups left with one page, {chain_row['wanted_generated_kept']:.1%} of the wanted ones kept (one per "
            f"group), {chain_row['real_pages_kept']} real pages kept; {tokens:,} tokens "
            f"({report['seconds']} s)"
        )
    return report
