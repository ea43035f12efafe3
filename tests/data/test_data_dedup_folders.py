"""Exact, line and MinHash dedup run stage by stage over small folders of files whose duplicate structure is
known, checked against the hand-written survivors; datatrove's MinHash dedup on the same files as a second
reference for the clusters.

A folder holds shards (``shard_0/``, ``shard_1/``), each a few ``.txt`` files, one document per file read in
name order; the outputs keep the files' names.
"""

import random
from pathlib import Path

import pytest

from lmstack.data.dedup.exact import (
    ExactDedupFilter,
    LineDedup,
    duplicate_lines,
    exact_duplicates,
    exact_hashes,
    line_counts,
)
from lmstack.data.dedup.minhash import (
    MinHashConfig,
    MinHashFilter,
    load_clusters,
    minhash_buckets,
    minhash_clusters,
    minhash_confirm,
    minhash_signatures,
)
from lmstack.data.dedup.runs import node
from lmstack.data.document import Document
from lmstack.data.step import StepStats


def make_folder(root: Path, shards: list[dict[str, str]]) -> Path:
    for t, files in enumerate(shards):
        (root / f"shard_{t}").mkdir(parents=True)
        for name, text in files.items():
            (root / f"shard_{t}" / name).write_text(text, encoding="utf-8")
    return root


def read_shards(root: Path) -> list[list[Document]]:
    return [
        [Document(f.read_text(encoding="utf-8"), f.name) for f in sorted(d.glob("*.txt"))]
        for d in sorted(root.glob("shard_*"))
    ]


def write_shard(out: Path, docs) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for doc in docs:
        (out / doc.id).write_text(doc.text, encoding="utf-8")


def test_exact_document_dedup(tmp_path):
    """Copies that normalise alike (case, punctuation, accents, spacing) are dropped; the first in
    (shard, file order) survives, also across shards and hash-space parts."""
    root = make_folder(
        tmp_path / "in",
        [
            {
                "a.txt": "Hello, World!",
                "b.txt": "Crème brûlée recipe",
                "c.txt": "hello world",
                "d.txt": "Something else entirely.",
            },
            {
                "a.txt": "CREME   BRULEE recipe!!",
                "e.txt": "A new text",
                "f.txt": "Something else, entirely",
            },
        ],
    )
    shards = read_shards(root)
    work = tmp_path / "work"
    for t, docs in enumerate(shards):
        exact_hashes(docs, work, t)
    removed = sum(exact_duplicates(work, part, 3) for part in range(3))
    assert removed == 3
    kept, stats = [], []
    for t, docs in enumerate(shards):
        st = StepStats("exact")
        kept.append([d.id for d in ExactDedupFilter(work, t)(docs, st)])
        stats.append(st)
    assert kept == [["a.txt", "b.txt", "d.txt"], ["e.txt"]]
    assert [dict(s.dropped) for s in stats] == [{"exact_duplicate": 1}, {"exact_duplicate": 2}]


def test_line_dedup_across_the_corpus(tmp_path):
    """A line occurring twice anywhere (another file, another shard, the same file; compared normalised) is
    removed from every file; lines that occur once stay in order; blank lines are never removed; a file left
    with only duplicated lines is dropped; the rest keep their names."""
    root = make_folder(
        tmp_path / "in",
        [
            {
                "p1.txt": "Home | About | Contact\nThe first article's own sentence.\n\nCopyright 2024 Example Inc.",
                "p2.txt": "home about contact\nA second, different story.\nIt repeats itself.\nIt repeats itself!",
            },
            {
                "p3.txt": "Home - About - Contact\nCOPYRIGHT 2024 EXAMPLE INC\n",
                "p4.txt": "Unique line one.\n\nUnique line two.\nCopyright 2024 Example Inc.",
            },
        ],
    )
    shards = read_shards(root)
    work = tmp_path / "work"
    for t, docs in enumerate(shards):
        line_counts(docs, work, t)
    assert (
        sum(duplicate_lines(work, part, 2) for part in range(2)) == 3
    )  # nav bar, copyright, repeated line
    stats = StepStats("line_dedup")
    for t, docs in enumerate(shards):
        write_shard(tmp_path / "out" / f"shard_{t}", LineDedup(work)(docs, stats))
    out = {p.name: p.read_text(encoding="utf-8") for p in sorted((tmp_path / "out").rglob("*.txt"))}
    assert out == {
        "p1.txt": "The first article's own sentence.\n",
        "p2.txt": "A second, different story.",
        "p4.txt": "Unique line one.\n\nUnique line two.",
    }
    assert dict(stats.dropped) == {"duplicate_lines_only": 1}
    assert stats.counters["lines_removed"] == 8  # p1: 2, p2: 3, p3: 2, p4: 1


def _near_copy(rng: random.Random, text: str, vocab, frac: float) -> str:
    ws = text.split()
    for i in rng.sample(range(len(ws)), int(frac * len(ws))):
        ws[i] = rng.choice(vocab)
    return " ".join(ws)


def minhash_corpus():
    """Two shards: 24 unrelated 300-word documents, and planted copies: o03 twice (one in each shard), o07
    once with 1% of words changed and its case changed, o11 with punctuation, o15 with 1% changed plus a
    tail, and one pair at Jaccard ~0.5 (o19 vs a 7%-changed copy) that must NOT be merged."""
    rng = random.Random(0)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(8000)
    ]
    orig = {f"o{i:02d}.txt": " ".join(rng.choice(vocab) for _ in range(300)) for i in range(24)}
    s0 = dict(orig)
    s0["o03_copy.txt"] = orig["o03.txt"]
    s1 = {
        "d03.txt": orig["o03.txt"].upper(),
        "d07.txt": _near_copy(rng, orig["o07.txt"], vocab, 0.01).upper(),
        "d11.txt": orig["o11.txt"].replace(" ", ", ", 40),
        "d15.txt": _near_copy(rng, orig["o15.txt"], vocab, 0.01) + " and a short tail",
        "d19.txt": _near_copy(rng, orig["o19.txt"], vocab, 0.07),
        "x01.txt": " ".join(rng.choice(vocab) for _ in range(300)),
    }
    return [s0, s1]


def test_minhash_dedup_survivors(tmp_path):
    """The five stages as separate tasks (2 shards, 3 bucket tasks, 2 confirm tasks): exactly the planted
    near-copies are dropped, each cluster keeps its first document, and the ~0.5 pair stays apart."""
    root = make_folder(tmp_path / "in", minhash_corpus())
    shards = read_shards(root)
    work = tmp_path / "work"
    cfg = MinHashConfig()
    for t, docs in enumerate(shards):
        minhash_signatures(docs, work, t, cfg)
    for task in range(3):
        minhash_buckets(work, task, 3, cfg)
    for task in range(2):
        minhash_confirm(work, task, 2, cfg)
    minhash_clusters(work, cfg)
    kept = []
    for t, docs in enumerate(shards):
        st = StepStats("minhash")
        kept.append({d.id for d in MinHashFilter(work, t)(docs, st)})
    names = [[d.id for d in docs] for docs in shards]
    assert set(names[0]) - kept[0] == {"o03_copy.txt"}
    assert set(names[1]) - kept[1] == {"d03.txt", "d07.txt", "d11.txt", "d15.txt"}
    clusters = {
        tuple(sorted(_name(names, n) for n in members)) for members in load_clusters(work).values()
    }
    assert clusters == {
        ("d03.txt", "o03.txt", "o03_copy.txt"),
        ("d07.txt", "o07.txt"),
        ("d11.txt", "o11.txt"),
        ("d15.txt", "o15.txt"),
    }
    assert {_name(names, root) for root in load_clusters(work)} == {
        "o03.txt",
        "o07.txt",
        "o11.txt",
        "o15.txt",
    }


def _name(names, nd: int) -> str:
    return names[nd >> 32][nd & 0xFFFFFFFF]


@pytest.mark.slow
def test_minhash_clusters_match_datatrove(tmp_path):
    """datatrove's MinhashDedupSignature -> Buckets -> Cluster -> Filter (its default 14 x 8 bands, 5-grams,
    sha1 hashes) on the same files drops the same number of documents from the same clusters. Which member
    survives can differ: datatrove's union by size keeps the root of the larger set, lmstack the first
    document; so the comparison is of the clusters (removed + the document each duplicate was joined to)."""
    pytest.importorskip("datatrove")
    from datatrove.data import Document as DTDocument
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.utils.hashing import HashConfig

    root = make_folder(tmp_path / "in", minhash_corpus())
    shards = read_shards(root)
    names = [[d.id for d in docs] for docs in shards]
    dt = tmp_path / "dt"
    cfg = MinhashConfig(
        hash_config=HashConfig(hash_fc="sha1")
    )  # its xxhash default fails on str with xxhash 4
    for t, docs in enumerate(shards):
        MinhashDedupSignature(str(dt / "sigs"), config=cfg).run(
            iter(DTDocument(d.text, d.id) for d in docs), t, 2
        )
    for r in range(cfg.num_buckets):
        MinhashDedupBuckets(str(dt / "sigs"), str(dt / "buckets"), config=cfg).run(
            None, r, cfg.num_buckets
        )
    MinhashDedupCluster(str(dt / "buckets"), str(dt / "remove"), config=cfg).run(None, 0, 1)
    dt_removed = set()
    for t, docs in enumerate(shards):
        stream = iter(DTDocument(d.text, d.id) for d in docs)
        kept = {d.id for d in MinhashDedupFilter(str(dt / "remove")).run(stream, t, 2)}
        dt_removed |= {(t, n) for n in names[t] if n not in kept}

    work = tmp_path / "lm"
    lcfg = MinHashConfig(bands=14, rows=8, n_gram=5)
    for t, docs in enumerate(shards):
        minhash_signatures(docs, work, t, lcfg)
    minhash_buckets(work, 0, 1, lcfg)
    minhash_confirm(work, 0, 1, lcfg)
    minhash_clusters(work, lcfg)
    clusters = load_clusters(work)
    ours = {tuple(sorted(_name(names, n) for n in m)) for m in clusters.values()}
    # datatrove's clusters: group its removed documents with what they duplicate (by our clusters' members)
    assert len(dt_removed) == sum(len(m) - 1 for m in clusters.values()) == 5
    for members in ours:
        in_dt = [m for m in members if (_shard_of(names, m), m) in dt_removed]
        assert len(in_dt) == len(members) - 1, (
            members,
            in_dt,
        )  # one survivor per cluster in datatrove too
    assert not any(n in {"o19.txt", "d19.txt", "x01.txt"} for _, n in dt_removed)


def _shard_of(names, name: str) -> int:
    return next(t for t, ns in enumerate(names) if name in ns)


def test_node_packs_shard_and_index():
    assert int(node(3, 7)) == (3 << 32) | 7
    with pytest.raises(ValueError, match="task=-1"):
        node(-1, 0)


def _random_corpus(seed: int, shards: int = 3, docs: int = 40):
    """Documents of lines drawn from a small pool (so lines and whole documents repeat), with case and
    punctuation noise that normalisation must see through."""
    rng = random.Random(seed)
    pool = [
        " ".join(
            rng.choice(["alpha", "beta", "gamma", "delta", "eps", "zeta"])
            for _ in range(rng.randint(1, 4))
        )
        for _ in range(60)
    ]

    def noisy(line):
        return rng.choice([line, line.upper(), line + ".", "  " + line.title() + "!"])

    out = []
    for t in range(shards):
        shard = []
        for i in range(docs):
            lines = [noisy(rng.choice(pool)) for _ in range(rng.randint(1, 5))]
            if rng.random() < 0.2:
                lines.append("")
            shard.append(Document("\n".join(lines), f"{t}-{i}"))
        out.append(shard)
    return out


def test_exact_and_line_dedup_match_brute_force(tmp_path):
    """On random shards with repeats: exact dedup keeps the first document of each normalised text (a dict
    over all documents in order); line dedup removes exactly the lines whose normalised form a Counter over
    the whole corpus has seen more than once."""
    from collections import Counter

    from lmstack.data.dedup.normalize import normalize

    shards = _random_corpus(3)
    for t, docs in enumerate(shards):
        exact_hashes(docs, tmp_path / "exact", t)
        line_counts(docs, tmp_path / "lines", t)
    for part in range(4):
        exact_duplicates(tmp_path / "exact", part, 4)
        duplicate_lines(tmp_path / "lines", part, 4)
    first: dict[str, str] = {}
    for docs in shards:
        for d in docs:
            first.setdefault(normalize(d.text), d.id)
    want_docs = [[d.id for d in docs if first[normalize(d.text)] == d.id] for docs in shards]
    got_docs = [
        [d.id for d in ExactDedupFilter(tmp_path / "exact", t)(docs)]
        for t, docs in enumerate(shards)
    ]
    assert got_docs == want_docs

    counts = Counter(
        normalize(line) for docs in shards for d in docs for line in d.text.split("\n")
    )
    for _t, docs in enumerate(shards):
        got = {d.id: d.text for d in LineDedup(tmp_path / "lines")(docs)}
        for d in docs:
            kept = [
                line
                for line in d.text.split("\n")
                if not normalize(line) or counts[normalize(line)] == 1
            ]
            if any(normalize(line) for line in kept):
                assert got[d.id] == "\n".join(kept)
            else:
                assert d.id not in got
