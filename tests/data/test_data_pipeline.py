"""Pipelines: TOML files and the step registry, stages as barriers, stats and exclusions with hand-counted
totals, resume after kill -9 (byte-identical, no completed task run twice), local and Ray executors agree."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmstack.cli import main
from lmstack.data.executor import LocalExecutor, RayExecutor, StageFailed, run_task
from lmstack.data.pipeline import Pipeline, Stage, build_step
from lmstack.data.readers import JsonlReader
from lmstack.data.step import STEPS, Filter, Step, register_step
from lmstack.data.writers import JsonlWriter, read_records

REPO = Path(__file__).resolve().parents[2]

STEP_MODULE = '''
import time
from lmstack.data.step import Filter, Step

class Slow(Step):
    """Logs "start <rank>" when a task starts, then passes documents on, ``delay`` seconds each."""

    config_ignore = ("delay",)  # a relaunch may change it: the outputs are the same
    def __init__(self, log, delay=0.0):
        self.log, self.delay = log, delay
    def run(self, docs, stats):
        with open(self.log, "a") as f:
            f.write(f"start {self.rank}\\n")
        for d in docs:
            time.sleep(self.delay)
            stats.seen(d)
            stats.kept(d)
            yield d

class NoDrop(Filter):
    def reason(self, doc):
        return "contains_drop" if "drop" in doc.text else None

class Boom(Step):
    def run(self, docs, stats):
        for d in docs:
            if self.rank == 1:
                raise RuntimeError("task 1 always fails")
            yield d
'''


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """4 JSONL files of 5 records: records 0 and 3 of each say "drop"; file 2 has one more line that is not JSON."""
    (tmp_path / "stepmod.py").write_text(STEP_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(tmp_path), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    inp = tmp_path / "in"
    inp.mkdir()
    for i in range(4):
        lines = [
            json.dumps(
                {"text": f"file {i} doc {j}" + (" drop" if j in (0, 3) else "") + " body" * j}
            )
            for j in range(5)
        ]
        if i == 2:
            lines.insert(2, "{not json")
        (inp / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def toml(root, out, delay=0.0, extra=""):
    path = root / f"{out}.toml"
    path.write_text(
        textwrap.dedent(f'''
        output = "{root / out}"
        [[step]]
        type = "read_jsonl"
        paths = ["{root / "in"}"]
        [[step]]
        type = "stepmod:NoDrop"
        [[step]]
        type = "write_jsonl"
        output = "{root / out / "clean"}"
        max_docs = 2
        [[step]]
        type = "stepmod:Slow"  # after the writer: it sleeps while a shard is open
        log = "{root / out}.log"
        delay = {delay}
        {extra}
    ''')
    )
    return path


def tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` but the completion markers (they hold the wall time) and the stages'
    config.json (it holds the run's own paths)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and "completions" not in p.parts
        and p.suffix not in (".log", ".png")
        and p.name != "config.json"
    }


def test_toml_pipeline_counts_and_exclusions(corpus):
    p = Pipeline.from_toml(toml(corpus, "a"))
    assert [s.task_count() for s in p.stages] == [4]  # one task per input file
    LocalExecutor(1, progress=False).run(p)
    out = corpus / "a"
    assert sorted(os.listdir(out / "main" / "completions")) == [f"0000{i}.json" for i in range(4)]
    stats = [json.loads((out / "main" / "stats" / f"0000{i}.json").read_text()) for i in range(4)]
    reader, nodrop, writer, slow = (sum(t["steps"][k]["docs_out"] for t in stats) for k in range(4))
    assert (reader, nodrop, writer, slow) == (20, 12, 12, 12)  # 21 records, 1 bad; 8 say "drop"
    assert stats[2]["steps"][0]["dropped"] == {"bad_json": 1}
    assert [s["name"] for s in stats[0]["steps"]] == [
        "jsonl_reader",
        "no_drop",
        "jsonl_writer",
        "slow",
    ]
    # 3 kept per file, 2 per shard: 2 shards per task
    assert sorted(os.listdir(out / "clean")) == [
        f"0000{i}_0000{k}.jsonl.gz" for i in range(4) for k in range(2)
    ]
    kept = [r["text"] for f in sorted((out / "clean").iterdir()) for r in read_records(f)]
    assert kept == [f"file {i} doc {j}" + " body" * j for i in range(4) for j in (1, 2, 4)]
    excluded = [r for f in sorted((out / "main" / "excluded").iterdir()) for r in read_records(f)]
    assert [(r["step"], r["reason"]) for r in excluded].count(("no_drop", "contains_drop")) == 8
    assert [
        (r["step"], r["reason"], r["metadata"]["line"])
        for r in excluded
        if r["reason"] == "bad_json"
    ] == [("jsonl_reader", "bad_json", 3)]

    # the merged report: `lmstack data stats`
    assert main(["data", "stats", str(out)]) == 0
    merged = json.loads((out / "stats.json").read_text())["main"]
    assert merged["tasks"] == merged["world"] == 4
    assert [(s["name"], s["docs_in"], s["docs_out"]) for s in merged["steps"]] == [
        ("jsonl_reader", 21, 20),
        ("no_drop", 20, 12),
        ("jsonl_writer", 12, 12),
        ("slow", 12, 12),
    ]
    assert (out / "funnel.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_relaunch_skips_completed_tasks_and_refuses_another_split(corpus):
    path = toml(corpus, "a")
    LocalExecutor(1, progress=False).run(Pipeline.from_toml(path))
    LocalExecutor(1, progress=False).run(Pipeline.from_toml(path))
    assert (corpus / "a.log").read_text().split("\n").count(
        "start 0"
    ) == 1  # the second run did nothing
    p = Pipeline.from_toml(path)
    p.stages[0].tasks = 2
    with pytest.raises(ValueError, match="launched with 4 tasks"):
        LocalExecutor(1, progress=False).run(p)
    # another value in a step: its completed tasks' outputs came from the old one, so refused, naming it
    changed = toml(corpus, "a", extra="").read_text().replace("max_docs = 2", "max_docs = 3")
    path.write_text(changed)
    with pytest.raises(
        ValueError, match=r"another configuration \(jsonl_writer.max_docs: 2 then, 3 now"
    ):
        LocalExecutor(1, progress=False).run(Pipeline.from_toml(path))
    assert (corpus / "a.log").read_text().split("\n").count("start 1") == 1  # nothing ran again
    path.write_text(
        changed.replace("max_docs = 3", "max_docs = 2").replace("delay = 0.0", "delay = 0.01")
    )
    # config_ignore: delay may change
    LocalExecutor(1, progress=False).run(Pipeline.from_toml(path))
    with open(
        corpus / "in" / "part3.jsonl", "a"
    ) as f:  # the input changed under the completed tasks
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(ValueError, match=r"jsonl_reader.input_files"):
        LocalExecutor(1, progress=False).run(Pipeline.from_toml(path))


@pytest.mark.slow
def test_kill_9_mid_task_then_relaunch_is_byte_identical(corpus):
    LocalExecutor(1, progress=False).run(Pipeline.from_toml(toml(corpus, "ref")))
    path = toml(
        corpus, "b", delay=0.5
    )  # 3 records kept per task: 1.5 s, 0.5 s with each shard open
    out = corpus / "b"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmstack", "data", "run", str(path), "--no-progress"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        # task 0 complete, task 1 has renamed its first shard and is writing its second
        while not list((out / "clean").glob(".00001_00001.jsonl.gz.*.tmp")):
            assert proc.poll() is None and time.time() < deadline, (
                "the pipeline ended before it could be killed"
            )
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (out / "main" / "completions" / "00000.json").exists()
    assert not (out / "main" / "completions" / "00001.json").exists()
    assert any(
        p.name.startswith(".") for p in (out / "clean").iterdir()
    )  # the killed shard's temp file

    LocalExecutor(1, progress=False).run(
        Pipeline.from_toml(toml(corpus, "b", delay=0.0))
    )  # same run, no sleep
    starts = (corpus / "b.log").read_text().split()
    assert [starts[i + 1] for i in range(0, len(starts), 2)] == [
        "0",
        "1",
        "1",
        "2",
        "3",
    ]  # task 0 never again
    assert tree(out) == tree(corpus / "ref")


def test_stages_run_in_order_and_a_failed_task_stops_the_run(corpus):
    out = corpus / "ms"
    first = Stage(
        "split",
        [JsonlReader(str(corpus / "in")), JsonlWriter(out / "s1", compression=None)],
        tasks=2,
    )
    second = Stage(
        "merge",
        [
            JsonlReader(str(out / "s1")),
            build_step({"type": "stepmod:NoDrop"}),
            JsonlWriter(out / "s2", compression=None),
        ],
        tasks=1,
    )
    LocalExecutor(1, progress=False).run(Pipeline([first, second], out))
    # stage 1: task 0 has files 0 and 2, task 1 files 1 and 3; stage 2 reads both after both finished
    assert sorted(os.listdir(out / "s1")) == ["00000_00000.jsonl", "00001_00000.jsonl"]
    assert len(list(read_records(out / "s2" / "00000_00000.jsonl"))) == 12

    bad = Pipeline(
        [
            Stage("boom", [JsonlReader(str(corpus / "in")), build_step({"type": "stepmod:Boom"})]),
            Stage("after", [JsonlReader(str(corpus / "in"))]),
        ],
        corpus / "bad",
    )
    with pytest.raises(
        StageFailed, match=r"(?s)stage 'boom': 1 task\(s\) failed \(\[1\]\).*task 1 always fails"
    ):
        LocalExecutor(1, progress=False).run(bad)
    assert sorted(os.listdir(corpus / "bad" / "boom" / "completions")) == [
        "00000.json",
        "00002.json",
        "00003.json",
    ]
    assert not (corpus / "bad" / "after").exists()


def test_registry_and_toml_errors(corpus, tmp_path):
    @register_step("test_only_keep_all")
    class KeepAll(Filter):
        def reason(self, doc):
            return None

    try:
        assert isinstance(build_step({"type": "test_only_keep_all"}), KeepAll)
        with pytest.raises(ValueError, match="already registered"):
            register_step("test_only_keep_all")(type("Other", (Step,), {}))
    finally:
        STEPS.pop("test_only_keep_all")
    with pytest.raises(ValueError, match=r"unknown step type 'gopher_qualty'.*read_jsonl"):
        build_step({"type": "gopher_qualty"})
    with pytest.raises(ValueError, match=r"step 1 \(type 'write_jsonl'\).*max_doc"):
        Pipeline.from_dict(
            {
                "output": "x",
                "step": [
                    {"type": "read_jsonl", "paths": ["in"]},
                    {"type": "write_jsonl", "output": "o", "max_doc": 3},
                ],
            }
        )
    one = Pipeline.from_dict(
        {
            "output": str(tmp_path / "o"),
            "tasks": 2,
            "step": [{"type": "read_jsonl", "paths": [str(corpus / "in")], "name": "src"}],
        }
    )
    assert one.stages[0].task_count() == 2 and one.stages[0].steps[0].name == "src"
    src = {"type": "read_jsonl", "paths": [str(corpus / "in")]}
    with pytest.raises(ValueError, match="lies inside stage 'main'.s input"):
        Pipeline.from_dict(
            {
                "output": str(tmp_path / "o"),
                "step": [src, {"type": "write_jsonl", "output": str(corpus / "in" / "clean")}],
            }
        )
    with pytest.raises(ValueError, match="inside stage 'main'.s log folder"):
        Pipeline.from_dict(
            {
                "output": str(tmp_path / "o"),
                "step": [src, {"type": "write_jsonl", "output": str(tmp_path / "o" / "main")}],
            }
        )
    with pytest.raises(ValueError, match="the pipeline's output"):
        Pipeline.from_dict({"output": str(corpus / "in" / "logs"), "step": [src]})
    with pytest.raises(ValueError, match="missing 'output'"):
        Pipeline.from_dict({"step": []})
    with pytest.raises(ValueError, match="either"):
        Pipeline.from_dict({"output": "x", "step": [], "stage": []})
    bad = tmp_path / "bad.toml"
    bad.write_text("output = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        Pipeline.from_toml(bad)


def test_cli_run_exit_codes(corpus, capsys):
    assert main(["data", "run", str(toml(corpus, "c")), "--no-progress"]) == 0
    assert "jsonl_reader" in capsys.readouterr().out
    assert main(["data", "run", str(corpus / "missing.toml")]) == 2


@pytest.mark.slow
def test_local_processes_give_the_same_outputs(corpus):
    LocalExecutor(1, progress=False).run(Pipeline.from_toml(toml(corpus, "one")))
    LocalExecutor(2, progress=False).run(Pipeline.from_toml(toml(corpus, "two")))
    assert tree(corpus / "one") == tree(corpus / "two") and tree(corpus / "one")


@pytest.mark.slow
def test_ray_executor_gives_the_same_outputs_and_stats(corpus, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    LocalExecutor(1, progress=False).run(Pipeline.from_toml(toml(corpus, "local")))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}},
    )
    try:
        RayExecutor(2, progress=False).run(Pipeline.from_toml(toml(corpus, "ray")))
        assert ray.is_initialized()  # it used this process's Ray and left it running
    finally:
        ray.shutdown()
    local, viaray = tree(corpus / "local"), tree(corpus / "ray")
    assert local == viaray and any(k.startswith("main/stats/") for k in local)
    assert sorted(os.listdir(corpus / "ray" / "main" / "completions")) == [
        f"0000{i}.json" for i in range(4)
    ]


def test_run_task_returns_none_for_a_completed_task(corpus):
    p = Pipeline.from_toml(toml(corpus, "d"))
    st = p.stages[0]
    assert run_task(st, 0, 4, p.output)["steps"][0]["docs_out"] == 5
    assert run_task(st, 0, 4, p.output) is None


def test_the_example_config_builds():
    p = Pipeline.from_toml(REPO / "configs" / "data" / "example.toml")
    assert [s.name for s in p.stages] == ["wet", "to_parquet"] and p.stages[1].tasks == 1
    assert [type(s).__name__ for s in p.stages[0].steps] == ["WetReader", "JsonlWriter"]
    assert p.stages[1].steps[1].max_bytes == 256_000_000


@pytest.mark.parametrize(
    "step, match",
    [
        (
            {"type": "gopher_qualty"},
            r"step 0: unknown step type 'gopher_qualty' \(did you mean 'gopher_quality'",
        ),
        (
            {"type": "gopher_quality", "min_doc_words": "fifty"},
            r"min_doc_words='fifty' is a str; expected int",
        ),
        (
            {"type": "gopher_quality", "max_ellipsis_lines_ratio": 30},
            r"max_ellipsis_lines_ratio=30 must be",
        ),
        ({"type": "gopher_quality", "min_doc_words": 50.5}, r"min_doc_words=50.5 is a float"),
        (
            {"type": "gopher_repetition", "top_n_grams": [[2, 20]]},
            r"top_n_grams\[n=2\] fraction=20",
        ),
        (
            {"type": "c4_quality", "min_words_per_line": -3},
            r"min_words_per_line=-3 must be an integer >= 0",
        ),
        ({"type": "fineweb_quality", "line_punct_thr": "0.12"}, r"line_punct_thr='0.12' is a str"),
        ({"type": "fineweb_quality", "short_line_thr": 67}, r"short_line_thr=67 must be"),
        (
            {"type": "language_filter", "threshold": 65},
            r"step 0 \(type 'language_filter'\).*got 65",
        ),
        ({"type": "language_filter", "min_share": 2}, r"min_share=2 must be in \[0, 1\]"),
        ({"type": "write_parquet", "output": "o", "compression": "zstdd"}, r"compression='zstdd'"),
        ({"type": "nsfw_filter", "threshold": 90}, r"nsfw_filter: threshold=90 must be"),
        ({"type": "toxic_filter", "threshold": "high"}, r"threshold='high' is a str"),
    ],
)
def test_a_typo_in_a_toml_step_is_an_error_naming_the_value(step, match):
    """Before: a string threshold was a TypeError inside the task, an out-of-range one silently changed
    the rule (30 for 0.3 turns it off); now each is a ValueError at load time naming the step and value."""
    with pytest.raises(ValueError, match=match):
        Pipeline.from_dict({"output": "x", "step": [step]}, "p.toml")
    step0 = [{"type": "read_jsonl", "paths": ["in"]}]
    with pytest.raises(ValueError, match=r"exclusions='no' must be true or false"):
        Pipeline.from_dict({"output": "x", "exclusions": "no", "step": step0}, "p.toml")
    with pytest.raises(ValueError, match=r"output=3 must be a folder path"):
        Pipeline.from_dict({"output": 3, "step": step0}, "p.toml")
    ok = {"type": "gopher_quality", "min_doc_words": 10, "max_avg_word_length": 12.5}
    assert build_step(ok).min_doc_words == 10  # right types and ranges still build


def test_a_local_ray_of_its_own_is_bound_to_localhost_with_usage_stats_off(corpus, monkeypatch):
    """What the executor passes to ray.init when it starts Ray itself (a stand-in ray module records it;
    no Ray is started): 127.0.0.1, no dashboard, and RAY_USAGE_STATS_ENABLED=0 in the environment."""
    import types

    seen = {}

    class Stop(Exception):
        pass

    def init(**kw):
        seen.update(kw, usage=os.environ.get("RAY_USAGE_STATS_ENABLED"))
        raise Stop

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    with pytest.raises(Stop):
        RayExecutor(2, progress=False).run(Pipeline.from_toml(toml(corpus, "r")))
    assert seen == {
        "address": "local",
        "include_dashboard": False,
        "_node_ip_address": "127.0.0.1",
        "usage": "0",
    }
