"""lmstack.data vs datatrove, side by side on the same generated corpus and the same steps, per core.

  .venv/bin/python benchmarks/data.py --json docs/data_bench.json          # about 4-5 minutes on this machine
  .venv/bin/python benchmarks/data.py --real-pages 40 --minhash-docs 1000  # quicker

Stages (one process each, CPU seconds of this process: ``time.process_time``, one BLAS thread; the machine
may be shared, so wall time is not the measure):

- **extraction**: the demo crawl's HTML (``lmstack.data.corpus``: real Debian documentation pages plus the
  labelled generated pages, binary records left out). lmstack: the ``extract`` step (resiliparse, main
  content, decoding from the bytes included) and the same step with ``engine="trafilatura"``; datatrove 0.10:
  its ``Trafilatura`` extractor (its default; 0.10 ships no resiliparse extractor), ``extract()`` called
  directly on the decoded string (its pipeline step runs each document in a sandbox process with a timeout,
  whose CPU time this process would not see); each extractor ``--repeats`` times, interleaved, the least
  CPU time kept. Kept = a non-empty text; agreement = mean Jaccard of the two
  outputs' word sets on the documents both keep.
- **Gopher quality**: lmstack ``GopherQuality(stop_words_case_sensitive=True)`` (datatrove's convention) vs
  datatrove ``GopherQualityFilter`` (spaCy's English tokenizer, loaded before timing) on lmstack's extracted
  texts; the kept sets are compared document by document.
- **MinHash** (signatures -> buckets -> clusters, 14 bands x 8 rows of word 5-grams): ``benchmarks/data_dedup.py``'s
  corpus and runs, called from here (its docstring says what each side does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data_dedup  # noqa: E402  (the MinHash half lives there)

from lmstack.data.document import Document  # noqa: E402


def _words(text: str) -> set[str]:
    return set(text.lower().split())


def crawl(real_limit: int, seed: int = 0) -> list:
    from lmstack.data.corpus import generated_records, real_records

    recs = list(real_records(real_limit)) + list(generated_records(random.Random(seed)))
    return [r for r in recs if r.labels["kind"] != "binary"]


def _cpu(fn, items):
    out, t0 = [], time.process_time()
    for x in items:
        out.append(fn(x))
    return out, time.process_time() - t0


def bench_extract(records, with_datatrove: bool, repeats: int = 1) -> tuple[dict, list[str]]:
    """Each extractor ``repeats`` times, the runs interleaved (lmstack resiliparse, lmstack trafilatura,
    datatrove, then again), the least CPU time of each kept: on a shared machine the minimum is the run
    least disturbed by the other jobs."""
    from lmstack.data.extract import Extract, decode_html
    from lmstack.data.step import StepStats

    mb = sum(len(r.payload) for r in records) / 1e6
    docs = [
        Document("", r.url, {"raw": r.payload, "content_type": r.content_type}) for r in records
    ]
    res = {"docs": len(docs), "mb": mb, "repeats": repeats}
    runs = {}
    for engine in ("resiliparse", "trafilatura"):
        step = Extract(engine=engine)
        step.apply(
            Document("", "w", {"raw": b"<html><body><p>warm up</p></body></html>"}), StepStats("w")
        )
        st = StepStats("extract")
        runs[f"lmstack {engine}"] = (
            (
                lambda d, step=step, st=st: (
                    step.apply(Document(d.text, d.id, dict(d.metadata)), st).text
                )
            ),
            docs,
        )
    import trafilatura

    strings = [decode_html(r.payload, r.content_type) for r in records]

    def direct(h):  # what lmstack's engine called before it parsed the page itself
        out = trafilatura.extract(
            h, include_comments=False, include_tables=True, favor_precision=True
        )
        return (out or "").strip()

    runs["trafilatura.extract on the string"] = direct, strings
    if with_datatrove:
        from datatrove.pipeline.extractors import Trafilatura

        dt = Trafilatura()
        dt.extract("<html><body><p>warm up the extractor</p></body></html>")
        html = [
            decode_html(r.payload, r.content_type) for r in records
        ]  # decoded outside the timing

        def one(h):
            try:
                return dt.extract(h) or ""
            except Exception:
                return ""

        runs["datatrove trafilatura"] = one, html
    texts, cpus = {}, {label: [] for label in runs}
    for _ in range(repeats):
        for label, (fn, items) in runs.items():
            out, cpu = _cpu(fn, items)
            if label in texts and out != texts[label]:
                raise AssertionError(f"{label}: another text on a repeat")
            texts[label] = out
            cpus[label].append(cpu)
    for label, out in texts.items():
        cpu = min(cpus[label])
        res[label] = {
            "cpu_s": cpu,
            "cpu_s_runs": cpus[label],
            "docs_per_s": len(docs) / cpu,
            "mb_per_s": mb / cpu,
            "kept": sum(bool(t) for t in out),
        }
    if texts["trafilatura.extract on the string"] != texts["lmstack trafilatura"]:
        raise AssertionError("lmstack's trafilatura engine changed trafilatura's text")
    res["lmstack trafilatura"]["vs_extract_on_string"] = (
        res["trafilatura.extract on the string"]["cpu_s"] / res["lmstack trafilatura"]["cpu_s"]
    )
    if with_datatrove:
        out, cpu = texts["datatrove trafilatura"], res["datatrove trafilatura"]["cpu_s"]
        for label in ("lmstack resiliparse", "lmstack trafilatura"):
            both = [(a, b) for a, b in zip(texts[label], out) if a and b]
            sims = [
                len(_words(a) & _words(b)) / max(1, len(_words(a) | _words(b))) for a, b in both
            ]
            res[label]["vs_datatrove"] = {
                "speedup": cpu / res[label]["cpu_s"],
                "both_kept": len(both),
                "only_lmstack": sum(bool(a) and not b for a, b in zip(texts[label], out)),
                "only_datatrove": sum(bool(b) and not a for a, b in zip(texts[label], out)),
                "mean_word_jaccard": sum(sims) / max(1, len(sims)),
            }
    return res, texts["lmstack resiliparse"]


def bench_gopher(texts: list[str], with_datatrove: bool) -> dict:
    from lmstack.data.quality import GopherQuality

    texts = [t for t in texts if t]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    ours = GopherQuality(stop_words_case_sensitive=True)
    ours.reason(Document("warm up the rules with a few words", "w"))
    lm, cpu = _cpu(lambda t: ours.reason(Document(t, "x")), texts)
    res = {
        "docs": len(texts),
        "mb": mb,
        "lmstack": {
            "cpu_s": cpu,
            "docs_per_s": len(texts) / cpu,
            "mb_per_s": mb / cpu,
            "kept": sum(r is None for r in lm),
        },
    }
    if with_datatrove:
        from datatrove.data import Document as DTDocument
        from datatrove.pipeline.filters import GopherQualityFilter

        ref = GopherQualityFilter()
        ref.filter(DTDocument(text="warm up the spaCy tokenizer with a few words", id="w"))

        def one(t):
            r = ref.filter(DTDocument(text=t, id="x"))
            return None if r is True else (r[1] if isinstance(r, tuple) else "dropped")

        dt, cpu_dt = _cpu(one, texts)
        res["datatrove"] = {
            "cpu_s": cpu_dt,
            "docs_per_s": len(texts) / cpu_dt,
            "mb_per_s": mb / cpu_dt,
            "kept": sum(r is None for r in dt),
        }
        res["speedup"] = cpu_dt / cpu
        res["same_decision"] = sum((a is None) == (b is None) for a, b in zip(lm, dt))
        res["same_reason"] = sum(a == b for a, b in zip(lm, dt))
    return res


def bench_minhash(n_docs: int, with_datatrove: bool) -> dict:
    shards = data_dedup.make_corpus(n_docs, n_docs // 10, 4)
    n = sum(len(s) for s in shards)
    mb = sum(len(t.encode()) for s in shards for t in s) / 1e6
    res = {"docs": n, "mb": mb}
    with tempfile.TemporaryDirectory(prefix="data_bench_") as tmp:
        t_lm, removed_lm, groups_lm = data_dedup.run_lmstack(shards, Path(tmp) / "lm")
        runs = {"lmstack": t_lm}
        if with_datatrove:
            t_dt, removed_dt, groups_dt = data_dedup.run_datatrove(shards, Path(tmp) / "dt")
            runs["datatrove"] = t_dt
    for lib, t in runs.items():
        res[lib] = {
            s: {"cpu_s": c, "docs_per_s": n / c, "mb_per_s": mb / c} for s, c in t.cpu.items()
        }
    if with_datatrove:
        res["speedup"] = {s: t_dt.cpu[s] / t_lm.cpu[s] for s in t_dt.cpu}
        res["speedup"]["all (lmstack with confirm)"] = sum(t_dt.cpu.values()) / sum(
            t_lm.cpu.values()
        )
        first_dt = {d for g in groups_dt for d in g[1:]}
        res["survivors"] = {
            "lmstack_removed": len(removed_lm),
            "datatrove_removed": len(removed_dt),
            "same_clusters": sorted(groups_lm) == groups_dt,
            "same_survivors_first_rule": first_dt == removed_lm,
            "differences": data_dedup.explain(shards, groups_lm, groups_dt),
        }
    return res


def _row(name, r, base=None):
    ratio = f"{base / r['cpu_s']:.2f}x" if base else ""
    return f"| {name} | {r['cpu_s']:.2f} | {r['docs_per_s']:,.0f} | {r['mb_per_s']:.2f} | {ratio} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--real-pages", type=int, default=120, help="real HTML pages in the crawl (at most)"
    )
    ap.add_argument("--minhash-docs", type=int, default=2000)
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs of each extractor (the least CPU time is kept)"
    )
    ap.add_argument("--skip-datatrove", action="store_true")
    ap.add_argument(
        "--stages",
        default="extraction,gopher,minhash",
        help="which comparisons to run (comma-separated)",
    )
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    with_dt = not args.skip_datatrove
    import torch

    load = os.getloadavg()
    result = {"cpu": torch.backends.cpu.get_cpu_capability(), "load_average": load}
    print(f"CPU capability {result['cpu']}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    records = crawl(args.real_pages)
    stages = set(args.stages.split(","))
    if stages - {"extraction", "gopher", "minhash"}:
        raise SystemExit(f"--stages {args.stages!r}: expected extraction, gopher, minhash")
    if "extraction" in stages:
        ex, texts = bench_extract(records, with_dt, args.repeats)
        result["extraction"] = ex
        print(f"\nextraction: {ex['docs']} HTML pages, {ex['mb']:.2f} MB")
        print("| extractor | CPU s | docs/s | MB/s | lmstack / datatrove |\n|---|---|---|---|---|")
        base = ex.get("datatrove trafilatura", {}).get("cpu_s")
        for name in (
            "lmstack resiliparse",
            "lmstack trafilatura",
            "trafilatura.extract on the string",
            "datatrove trafilatura",
        ):
            if name in ex:
                print(
                    _row(name, ex[name], None if name.startswith("datatrove") else base)
                    + f" kept {ex[name]['kept']}"
                )
        for name in ("lmstack resiliparse", "lmstack trafilatura"):
            if "vs_datatrove" in ex[name]:
                v = ex[name]["vs_datatrove"]
                print(
                    f"{name} vs datatrove: both keep {v['both_kept']}, only lmstack {v['only_lmstack']}, only datatrove "
                    f"{v['only_datatrove']}; mean word-set Jaccard of the outputs {v['mean_word_jaccard']:.3f}"
                )
    elif "gopher" in stages:  # Gopher's input: lmstack's resiliparse texts
        texts = bench_extract(records, False, 1)[1]
    if "gopher" in stages:
        gq = bench_gopher(texts, with_dt)
        result["gopher_quality"] = gq
        print(f"\nGopher quality: {gq['docs']} extracted texts, {gq['mb']:.2f} MB")
        print("| library | CPU s | docs/s | MB/s | lmstack / datatrove |\n|---|---|---|---|---|")
        print(
            _row("lmstack", gq["lmstack"], gq.get("datatrove", {}).get("cpu_s"))
            + f" kept {gq['lmstack']['kept']}"
        )
        if with_dt:
            print(_row("datatrove", gq["datatrove"]) + f" kept {gq['datatrove']['kept']}")
            print(
                f"same keep/drop decision on {gq['same_decision']} of {gq['docs']}, same reason on {gq['same_reason']}"
            )
    if "minhash" in stages:
        mh = bench_minhash(args.minhash_docs, with_dt)
        result["minhash"] = mh
        print(
            f"\nMinHash: {mh['docs']} documents, {mh['mb']:.2f} MB (benchmarks/data_dedup.py's corpus)"
        )
        print(
            "| stage | lmstack CPU s | MB/s | datatrove CPU s | MB/s | lmstack / datatrove |\n|---|---|---|---|---|---|"
        )
        for stage, r in mh["lmstack"].items():
            d = mh.get("datatrove", {}).get(stage)
            print(
                f"| {stage} | {r['cpu_s']:.3f} | {r['mb_per_s']:.2f} | "
                + (
                    f"{d['cpu_s']:.3f} | {d['mb_per_s']:.2f} | {mh['speedup'][stage]:.2f}x |"
                    if d
                    else "- | - | - |"
                )
            )
        if with_dt:
            print(
                f"all stages: {mh['speedup']['all (lmstack with confirm)']:.2f}x; survivors: {mh['survivors']}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=float) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
