"""Dedup wired into the pipeline: a TOML file of [[stage]] tables (first stage mid-stream, global stages with
their own task counts, filters in a later stage over the written shards) on a folder of files whose duplicate
structure is built by hand; survivors checked against the hand-written rule (the first copy in (task, index)
order survives), 1 worker == 2 workers byte for byte, a relaunch after completion writes nothing."""

import os
import random
from pathlib import Path

import pytest

from lmstack.data.executor import LocalExecutor
from lmstack.data.pipeline import Pipeline
from lmstack.data.report import merge_stats
from lmstack.data.writers import read_records

VOCAB = [
    "".join(
        random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=random.Random(-i).randint(3, 9))
    )
    for i in range(3000)
]


def _text(rng: random.Random, n: int = 300) -> list[str]:
    return [rng.choice(VOCAB) for _ in range(n)]


def _edit(words: list[str], k: int, rng: random.Random) -> list[str]:
    out = list(words)
    for pos in rng.sample(range(len(out)), k):
        out[pos] = f"changed{pos}"
    return out


def _jaccard5(a: str, b: str) -> float:
    """Hand reference: word 5-gram sets of the lower-cased, punctuation-free texts."""

    def grams(t):
        ws = "".join(c if c.isalnum() else " " for c in t.lower()).split()
        return {tuple(ws[i : i + 5]) for i in range(len(ws) - 4)}

    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


@pytest.fixture
def folder(tmp_path):
    rng = random.Random(0)
    a, b, c, d, e = (_text(rng) for _ in range(5))
    files = {
        "a0": " ".join(a),
        "a1": " ".join(_edit(a, 3, rng)),
        "a2": " ".join(a).upper() + " !!",  # a2: exact copy
        "b0": " ".join(b),
        "b1": " ".join(_edit(b, 2, rng)),
        "c0": " ".join(c),
        "c1": " ".join(_edit(c, 3, rng)),
        "d0": " ".join(d),
        "d1": " ".join(_edit(d, 120, rng)),  # far apart: both stay
        "e0": " ".join(e),
    }
    for x, y in (("a0", "a1"), ("b0", "b1"), ("c0", "c1")):
        assert _jaccard5(files[x], files[y]) > 0.85
    assert _jaccard5(files["a0"], files["a2"]) == 1.0 and _jaccard5(files["d0"], files["d1"]) < 0.2
    inp = tmp_path / "in"
    inp.mkdir()
    for name, text in files.items():
        (inp / f"{name}.txt").write_text(text, encoding="utf-8")
    return tmp_path, files


TOML = """
output = "{out}"
[[stage]]
name = "prepare"
tasks = 3
[[stage.step]]
type = "read_text"
paths = ["{inp}"]
[[stage.step]]
type = "exact_hashes"
[[stage.step]]
type = "minhash_signatures"
bands = 14
rows = 8
threshold = 0.8
[[stage.step]]
type = "write_jsonl"
output = "{out}/docs"

[[stage]]
name = "exact_duplicates"
tasks = 2
[[stage.step]]
type = "exact_duplicates"
[[stage]]
name = "buckets"
tasks = 3
[[stage.step]]
type = "minhash_buckets"
[[stage]]
name = "confirm"
tasks = 2
[[stage.step]]
type = "minhash_confirm"
[[stage]]
name = "clusters"
[[stage.step]]
type = "minhash_clusters"

[[stage]]
name = "dedup"
[[stage.step]]
type = "read_jsonl"
paths = ["{out}/docs"]
[[stage.step]]
type = "exact_filter"
[[stage.step]]
type = "minhash_filter"
[[stage.step]]
type = "write_jsonl"
output = "{out}/final"
compression = "none"
"""


def _run(root: Path, name: str, workers: int) -> Path:
    out = root / name
    path = root / f"{name}.toml"
    path.write_text(TOML.format(out=out, inp=root / "in"))
    LocalExecutor(workers, progress=False).run(Pipeline.from_toml(path))
    return out


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and "completions" not in p.parts and p.name != "config.json"
    }  # markers hold the task's wall time, a stage's config.json the run's own paths


@pytest.mark.slow
def test_minhash_pipeline_survivors_workers_and_relaunch(folder):
    root, files = folder
    out1 = _run(root, "one", 1)
    # the hand-written rule: file i (in name order) is task i % 3, index i // 3; a group's smallest
    # (task, index) survives: a0 (0,0) over a1 (1,0), a2 (2,0); b0 (0,1) over b1 (1,1); c1 (0,2) over c0 (2,1)
    kept = {r["text"] for f in sorted((out1 / "final").iterdir()) for r in read_records(f)}
    by_text = {t: n for n, t in files.items()}
    assert sorted(by_text[t] for t in kept) == ["a0", "b0", "c1", "d0", "d1", "e0"]
    steps = {s.name: s for s in merge_stats(out1)["dedup"]["steps"]}
    assert dict(steps["exact_filter"].dropped) == {"exact_duplicate": 1}  # a2
    assert dict(steps["minhash_filter"].dropped) == {"minhash_duplicate": 3}  # a1, b1, c0
    assert merge_stats(out1)["clusters"]["steps"][0].counters["removed"] == 4  # a1, a2, b1, c0
    assert (out1 / "dedup" / "minhash" / "config.json").is_file()

    out2 = _run(root, "two", 2)
    one, two = _files(out1), _files(out2)
    assert sorted(one) == sorted(two) and one == two  # byte-identical, stats included

    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in out2.rglob("*")}
    LocalExecutor(2, progress=False).run(Pipeline.from_toml(root / "two.toml"))
    assert {
        p: (p.stat().st_mtime_ns, p.stat().st_size) for p in out2.rglob("*")
    } == before  # nothing ran


def test_dedup_step_errors(folder, tmp_path):
    from lmstack.data.dedup.steps import MinHashClusters, MinHashDedupFilter
    from lmstack.data.pipeline import Stage
    from lmstack.data.readers import TextReader

    root, _ = folder
    with pytest.raises(ValueError, match="no work folder"):
        list(MinHashDedupFilter()([]))
    bad = Pipeline(
        [Stage("s", [TextReader(str(root / "in")), MinHashClusters()], tasks=1)], tmp_path / "o1"
    )
    assert bad.stages[0].steps[1].folder == str(tmp_path / "o1" / "dedup" / "minhash")
    with pytest.raises(Exception, match="not documents"):
        LocalExecutor(1, progress=False).run(bad)
    two = Pipeline([Stage("c", [MinHashClusters()], tasks=2)], tmp_path / "o2")
    with pytest.raises(Exception, match="tasks = 1"):
        LocalExecutor(1, progress=False).run(two)


def test_the_dedup_example_config_builds():
    p = Pipeline.from_toml(Path(__file__).resolve().parents[2] / "configs" / "data" / "dedup.toml")
    assert [s.name for s in p.stages] == [
        "filter",
        "exact_duplicates",
        "minhash_buckets",
        "minhash_confirm",
        "minhash_clusters",
        "dedup",
    ]
    assert [s.tasks for s in p.stages[1:5]] == [4, 14, 4, 1]
    work = {s.folder for st in p.stages for s in st.steps if hasattr(s, "dedup")}
    assert work == {
        os.path.join(p.output, "dedup", "exact"),
        os.path.join(p.output, "dedup", "minhash"),
    }


@pytest.mark.slow
def test_ray_runs_the_dedup_pipeline_to_the_same_bytes(folder, monkeypatch):
    ray = pytest.importorskip("ray")
    from lmstack.data.executor import RayExecutor

    root, _ = folder
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    out1 = _run(root, "local", 1)
    path = root / "ray.toml"
    path.write_text(TOML.format(out=root / "ray", inp=root / "in"))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
    )
    try:
        RayExecutor(2, progress=False).run(Pipeline.from_toml(path))
    finally:
        ray.shutdown()
    assert _files(out1) == _files(root / "ray")
