"""Fuzzy dedup benchmark: lmstack's MinHash stages vs datatrove's, on one generated corpus with planted
near-duplicates; then the peak memory of lmstack's fuzzy dedup against the corpus size.

  .venv/bin/python benchmarks/data_dedup.py                      # 3000 documents, 4 shards, both libraries
  .venv/bin/python benchmarks/data_dedup.py --docs 1000 --skip-memory

Stages, both with 14 bands x 8 rows of word 5-grams, one process (so per core), CPU seconds of this
process (the machine is shared; wall time is printed too):

- signatures: lmstack ``minhash_signatures`` (also writes the shingle sets to confirm with) vs datatrove
  ``MinhashDedupSignature`` (its xxhash64 default, on UTF-8 bytes: datatrove 0.10 passes str, which xxhash 4
  refuses);
- buckets: lmstack ``minhash_buckets`` (vectorised k-way merge of each band's sorted runs) vs datatrove
  ``MinhashDedupBuckets`` (a heapq merge, one task per band);
- confirm: lmstack ``minhash_confirm`` (true Jaccard of every candidate pair), a stage datatrove does not
  have (it keeps every LSH candidate);
- clusters: lmstack ``minhash_clusters`` vs datatrove ``MinhashDedupCluster`` (union-find over the pairs).

The corpus: Zipf-distributed words from a generated vocabulary in sentences and paragraphs; a fraction of
documents are near-copies (1-3% of words changed, case changed, a tail added) of earlier ones, some in
clusters of up to 5. Survivor sets are compared: datatrove keeps the root of its union-by-size tree,
lmstack the first document of each cluster, so the comparison is of the removed count and of the clusters.

Memory: tracemalloc's peak (numpy reports its buffers to it) during each stage, for corpora of growing size
(fixed shard size) with (a) a fixed number of planted duplicates and (b) duplicates in proportion — the
buckets/confirm/cluster peak follows the duplicate edges, not the corpus, once the corpus exceeds the merge's
record budget (``--merge-budget``, small here so that the scan's corpora exceed it). A PNG goes to --png.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from lmstack.data.dedup.minhash import (
    MinHashConfig,
    load_clusters,
    minhash_buckets,
    minhash_clusters,
    minhash_confirm,
    minhash_signatures,
)
from lmstack.data.document import Document

BANDS, ROWS, NGRAM = 14, 8, 5


# ---- corpus --------------------------------------------------------------------------------------


def make_vocab(rng: random.Random, n: int = 30_000) -> list[str]:
    syl = [
        "ka",
        "to",
        "ri",
        "men",
        "sa",
        "lo",
        "ne",
        "vi",
        "da",
        "po",
        "gre",
        "an",
        "th",
        "es",
        "ul",
        "or",
        "ing",
        "qu",
        "ba",
        "el",
        "ti",
        "con",
        "ver",
        "st",
        "ed",
        "ro",
        "ma",
        "un",
        "pre",
        "ly",
    ]
    seen, out = set(), []
    while len(out) < n:
        w = "".join(rng.choice(syl) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def make_text(rng: random.Random, vocab: list[str], weights, n_words: int) -> str:
    ws = rng.choices(vocab, weights=weights, k=n_words)
    out, i = [], 0
    while i < len(ws):
        n = rng.randint(5, 25)
        sent = ws[i : i + n]
        sent[0] = sent[0].capitalize()
        out.append(" ".join(sent) + rng.choice((".", ".", ".", "?", "!")))
        if rng.random() < 0.15:
            out.append("\n\n")
        i += n
    return " ".join(out).replace(" \n\n ", "\n\n")


def near_copy(rng: random.Random, text: str, vocab: list[str], frac: float) -> str:
    ws = text.split(" ")
    for i in rng.sample(range(len(ws)), max(1, int(frac * len(ws)))):
        ws[i] = rng.choice(vocab)
    out = " ".join(ws)
    if rng.random() < 0.3:
        out = out.upper()
    if rng.random() < 0.3:
        out += " Share this page. Read more."
    return out


def make_corpus(
    n_docs: int,
    dup_docs: int,
    shards: int,
    seed: int = 0,
    words=(150, 1200),
    max_edit: float = 0.02,
) -> list[list[str]]:
    """``n_docs`` documents of which ``dup_docs`` are near-copies of earlier originals (clusters of 2-5),
    dealt round-robin into ``shards`` shards (so copies land in other shards)."""
    rng = random.Random(seed)
    vocab = make_vocab(rng)
    weights = [1.0 / (r + 1) ** 1.1 for r in range(len(vocab))]
    originals = [
        make_text(rng, vocab, weights, rng.randint(*words)) for _ in range(n_docs - dup_docs)
    ]
    docs = list(originals)
    while len(docs) < n_docs:
        src = rng.randrange(len(originals))
        for _ in range(min(rng.choice((1, 1, 1, 2, 3, 4)), n_docs - len(docs))):
            docs.append(near_copy(rng, originals[src], vocab, rng.uniform(0.0, max_edit)))
    order = list(range(len(originals))) + rng.sample(
        range(len(originals), n_docs), n_docs - len(originals)
    )
    out: list[list[str]] = [[] for _ in range(shards)]
    for j, i in enumerate(order):
        out[j % shards].append(docs[i])
    return out


# ---- runs ----------------------------------------------------------------------------------------


class Timer:
    def __init__(self):
        self.cpu, self.wall = {}, {}

    def __call__(self, name):
        timer = self

        class _T:
            def __enter__(self):
                self.c, self.w = time.process_time(), time.perf_counter()

            def __exit__(self, *exc):
                timer.cpu[name] = timer.cpu.get(name, 0.0) + time.process_time() - self.c
                timer.wall[name] = timer.wall.get(name, 0.0) + time.perf_counter() - self.w

        return _T()


def run_lmstack(shards: list[list[str]], folder: Path) -> tuple[Timer, set, list]:
    cfg = MinHashConfig(bands=BANDS, rows=ROWS, n_gram=NGRAM)
    docs = [
        [Document(t, f"{s}-{i}") for i, t in enumerate(texts)] for s, texts in enumerate(shards)
    ]
    minhash_signatures([Document("warm up the code paths", "w")], folder / "warm", 0, cfg)
    t = Timer()
    with t("signatures"):
        for s, d in enumerate(docs):
            minhash_signatures(d, folder, s, cfg)
    with t("buckets"):
        t.pairs = minhash_buckets(folder, 0, 1, cfg)
    with t("confirm"):
        t.edges = minhash_confirm(folder, 0, 1, cfg)
    with t("clusters"):
        minhash_clusters(folder, cfg)
    clusters = load_clusters(folder)
    removed = {(n >> 32, n & 0xFFFFFFFF) for members in clusters.values() for n in members[1:]}
    groups = [sorted((n >> 32, n & 0xFFFFFFFF) for n in m) for m in clusters.values()]
    return t, removed, groups


def run_datatrove(shards: list[list[str]], folder: Path) -> tuple[Timer, set, list]:
    import logging

    import xxhash
    from datatrove.data import Document as DTDocument
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.utils.logging import logger

    logger.remove()
    logging.disable(logging.INFO)
    cfg = MinhashConfig(n_grams=NGRAM, num_buckets=BANDS, hashes_per_bucket=ROWS)
    sig = str(folder / "sigs")
    t = Timer()
    steps = []
    for _s in range(len(shards)):
        step = MinhashDedupSignature(sig, config=cfg)
        step._hash_func = lambda x: xxhash.xxh64_intdigest(
            x.encode("utf-8")
        )  # its default, on bytes
        step.word_tokenizer.word_tokenize(
            "warm up the tokenizer"
        )  # spaCy loads on first use: not timed
        steps.append(step)
    with t("signatures"):
        for s, texts in enumerate(shards):
            steps[s].run(
                iter(DTDocument(x, f"{s}-{i}") for i, x in enumerate(texts)), s, len(shards)
            )
    with t("buckets"):
        for b in range(BANDS):
            MinhashDedupBuckets(sig, str(folder / "buckets"), config=cfg).run(None, b, BANDS)
    with t("clusters"):
        MinhashDedupCluster(
            str(folder / "buckets"), str(folder / "remove"), config=cfg, save_cluster_id=True
        ).run(None, 0, 1)
    removed = set()
    for s, texts in enumerate(shards):
        kept = {
            d.id
            for d in MinhashDedupFilter(str(folder / "remove")).run(
                iter(DTDocument(x, f"{s}-{i}") for i, x in enumerate(texts)), s, len(shards)
            )
        }
        removed |= {(s, i) for i in range(len(texts)) if f"{s}-{i}" not in kept}
    groups: dict[int, list] = {}  # its .clusters files: (document index, cluster id) per shard
    for s in range(len(shards)):
        f = folder / "remove" / f"{s:06d}.clusters"
        if f.exists():
            for doc, cid in np.fromfile(f, dtype="<u4").reshape(-1, 2).tolist():
                groups.setdefault(cid, []).append((s, doc))
    return t, removed, sorted(sorted(g) for g in groups.values())


def explain(shards, groups_lm, groups_dt) -> list[str]:
    """One line per cluster the libraries disagree on: its members' true Jaccard similarity to each other."""
    from lmstack.data.dedup.minhash import MinHasher, jaccard

    h = MinHasher()
    lm, dt = {tuple(g) for g in groups_lm}, {tuple(g) for g in groups_dt}
    out = []
    for side, mine, other in (("lmstack", lm, dt), ("datatrove", dt, lm)):
        for g in sorted(mine - other):
            sets = [h.shingles(shards[s][i]) for s, i in g]
            js = [jaccard(sets[a], sets[b]) for a in range(len(g)) for b in range(a + 1, len(g))]
            out.append(
                f"only {side}: cluster of {len(g)} {list(g)}, pairwise Jaccard {min(js):.3f}..{max(js):.3f}"
            )
    return out


# ---- memory --------------------------------------------------------------------------------------


def peak_memory(shards: list[list[str]], folder: Path, budget: int) -> dict[str, float]:
    """tracemalloc peak (MB) of each lmstack stage on this corpus, and the number of confirmed edges."""
    cfg = MinHashConfig(bands=BANDS, rows=ROWS, n_gram=NGRAM)
    docs = [[Document(t, str(i)) for i, t in enumerate(texts)] for texts in shards]
    out = {}
    tracemalloc.start()
    for name, fn in (
        ("signatures", lambda: [minhash_signatures(d, folder, s, cfg) for s, d in enumerate(docs)]),
        ("buckets", lambda: minhash_buckets(folder, 0, 1, cfg, budget=budget)),
        ("confirm", lambda: minhash_confirm(folder, 0, 1, cfg)),
        ("clusters", lambda: minhash_clusters(folder, cfg)),
    ):
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        r = fn()
        out[name] = (tracemalloc.get_traced_memory()[1] - base) / 1e6
        if name == "confirm":
            out["edges"] = r
    tracemalloc.stop()
    return out


def plot_memory(mem: dict, path: str, per_shard: int) -> None:
    from lmstack.utils import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind in zip(axes, ("fixed", "proportional")):
        rows = mem[kind]
        x = [r["docs"] for r in rows]
        for stage in ("signatures", "buckets", "confirm", "clusters"):
            ax.plot(x, [r[stage] for r in rows], "o-", label=stage)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [f"{n}\n{r['edges']} edges" for n, r in zip(x, rows)])
        ax.minorticks_off()
        ax.set_title(
            "200 planted duplicates" if kind == "fixed" else "duplicates = 10% of the corpus"
        )
        ax.set_xlabel("documents in the corpus")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("peak traced memory (MB)")
    axes[0].legend()
    fig.suptitle(f"lmstack fuzzy dedup: peak memory per stage ({per_shard} documents per shard)")
    fig.tight_layout()
    save_png(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument(
        "--dup-frac", type=float, default=0.1, help="fraction of documents that are near-copies"
    )
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument(
        "--max-edit",
        type=float,
        default=0.02,
        help="a near-copy changes up to this fraction of words",
    )
    ap.add_argument(
        "--memory-sizes", default="2000,4000,8000,16000", help="corpus sizes for the memory scan"
    )
    ap.add_argument("--memory-docs-per-shard", type=int, default=1000)
    ap.add_argument(
        "--merge-budget",
        type=int,
        default=4096,
        help="records the memory scan's bucket merge holds (the library default is 2^20)",
    )
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-datatrove", action="store_true")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--png", help="write the memory plot here")
    args = ap.parse_args(argv)

    shards = make_corpus(
        args.docs, int(args.dup_frac * args.docs), args.shards, max_edit=args.max_edit
    )
    n_docs = sum(len(s) for s in shards)
    mb = sum(len(t.encode()) for s in shards for t in s) / 1e6
    print(
        f"corpus: {n_docs} documents, {mb:.1f} MB, {args.shards} shards, {int(args.dup_frac * args.docs)} "
        f"planted near-copies (up to {args.max_edit:.1%} of words changed); {BANDS} bands x {ROWS} rows, "
        f"{NGRAM}-grams"
    )
    result = {"docs": n_docs, "mb": mb, "stages": {}}
    tmp = Path(tempfile.mkdtemp(prefix="dedup_bench_"))
    try:
        t_lm, removed_lm, groups = run_lmstack(shards, tmp / "lm")
        runs = {"lmstack": t_lm}
        print(
            f"lmstack: {t_lm.pairs} candidate pairs, {t_lm.edges} confirmed (J >= 0.8), "
            f"{t_lm.pairs - t_lm.edges} rejected"
        )
        result["lmstack_pairs"] = {"candidates": t_lm.pairs, "confirmed": t_lm.edges}
        if not args.skip_datatrove:
            t_dt, removed_dt, groups_dt = run_datatrove(shards, tmp / "dt")
            runs["datatrove"] = t_dt
        print(
            f"\n{'stage':<11} {'library':<10} {'cpu s':>7} {'wall s':>7} {'docs/s':>9} {'MB/s':>7}"
        )
        for stage in ("signatures", "buckets", "confirm", "clusters"):
            result["stages"][stage] = {}
            for lib, t in runs.items():
                if stage not in t.cpu:
                    continue
                c = t.cpu[stage]
                result["stages"][stage][lib] = {
                    "cpu_s": c,
                    "wall_s": t.wall[stage],
                    "docs_per_s": n_docs / c,
                    "mb_per_s": mb / c,
                }
                print(
                    f"{stage:<11} {lib:<10} {c:7.2f} {t.wall[stage]:7.2f} {n_docs / c:9.0f} {mb / c:7.2f}"
                )
            if "datatrove" in runs and stage in runs["datatrove"].cpu:
                ratio = runs["datatrove"].cpu[stage] / runs["lmstack"].cpu[stage]
                result["stages"][stage]["speedup"] = ratio
                print(f"{'':<11} lmstack is {ratio:.2f}x datatrove per core")
        total = {lib: sum(t.cpu.values()) for lib, t in runs.items()}
        if "datatrove" in runs:
            print(
                f"all stages (lmstack with confirm): lmstack {total['lmstack']:.2f} s, "
                f"datatrove {total['datatrove']:.2f} s "
                f"({total['datatrove'] / total['lmstack']:.2f}x)"
            )
            # survivors by one rule (the first document of each cluster) on each library's clusters
            first_dt = {d for g in groups_dt for d in g[1:]}
            same = first_dt == removed_lm
            print(
                f"removed: lmstack {len(removed_lm)}, datatrove {len(removed_dt)}; clusters: lmstack {len(groups)}, "
                f"datatrove {len(groups_dt)}; the same clusters: {sorted(groups) == groups_dt}; the same survivors "
                f"when both keep each cluster's first document: {same}"
            )
            diff = explain(shards, groups, groups_dt)
            for line in diff:
                print("  " + line)
            result["survivors"] = {
                "lmstack_removed": len(removed_lm),
                "datatrove_removed": len(removed_dt),
                "lmstack_clusters": len(groups),
                "datatrove_clusters": len(groups_dt),
                "same_survivors_first_rule": same,
                "differences": diff,
            }
        if not args.skip_memory:
            sizes = [int(x) for x in args.memory_sizes.split(",")]
            mem = {"fixed": [], "proportional": []}
            print(
                f"\npeak memory (tracemalloc MB), {args.memory_docs_per_shard} documents per shard, 60-300 words, "
                f"merge budget {args.merge_budget} records:"
            )
            print(
                f"{'docs':>6} {'dups':>5} {'edges':>6} {'signatures':>10} {'buckets':>8} {'confirm':>8} "
                f"{'clusters':>8}"
            )
            for kind in ("fixed", "proportional"):
                for n in sizes:
                    d = 200 if kind == "fixed" else n // 10
                    s = make_corpus(
                        n, d, max(1, n // args.memory_docs_per_shard), seed=1, words=(60, 300)
                    )
                    m = peak_memory(s, tmp / f"mem_{kind}_{n}", args.merge_budget)
                    shutil.rmtree(tmp / f"mem_{kind}_{n}")
                    mem[kind].append({"docs": n, "dups": d, **m})
                    print(
                        f"{n:6d} {d:5d} {m['edges']:6d} {m['signatures']:10.2f} {m['buckets']:8.2f} "
                        f"{m['confirm']:8.2f} {m['clusters']:8.2f}"
                    )
            result["memory"] = mem
            if args.png:
                plot_memory(mem, args.png, args.memory_docs_per_shard)
                print(f"wrote {args.png}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
