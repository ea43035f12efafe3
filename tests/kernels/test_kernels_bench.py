"""The benchmarking harness (CS336 notes "基准测试"): timing, memory, NVTX off by default, the CLI."""

import json

import torch

from lmstack.kernels import bench


def test_time_fn_counts_warmup_and_repeats():
    calls = []
    t = bench.time_fn(lambda: calls.append(1), "cpu", warmup=2, repeats=5)
    assert len(calls) == 7 and t.repeats == 5 and len(t.times) == 5
    assert 0 <= t.min <= t.median


def test_peak_memory_cpu():
    with bench.track_peak_memory("cpu") as m:
        x = torch.ones(8 * 2**20 // 4)  # 8 MiB, touched
        x += 1
    assert m.peak_bytes > 0 and m.method.startswith("RSS")
    assert bench.peak_tensor_bytes(lambda: torch.ones(2**20 // 4) + 1) >= 2**20


def test_nvtx_is_a_noop_by_default(monkeypatch):
    """Even where CUDA is present, no NVTX range is pushed unless asked for; when asked, every
    push is popped (recorded through stand-ins for torch.cuda.nvtx, with CUDA reported present)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))

    with bench.nvtx_range("x"):
        pass

    @bench.nvtx_annotate("f")
    def f(a):
        return a + 1

    assert f(1) == 2 and calls == []
    with bench.nvtx_range("x", enabled=True):
        calls.append(("body",))

    @bench.nvtx_annotate(enabled=True)
    def g(a):
        return a * 3

    assert g(2) == 6
    g_name = "test_nvtx_is_a_noop_by_default.<locals>.g"  # the default label: the function's qualified name
    assert calls == [("push", "x"), ("body",), ("pop",), ("push", g_name), ("pop",)]


def test_format_table():
    text = bench.format_table([{"a": 1, "b": 0.123456}, {"a": 22, "b": None}])
    assert (
        text.splitlines()[0].split() == ["a", "b"]
        and "0.1235" in text
        and "-" in text.splitlines()[-1]
    )


def test_cli_attention_and_model(tmp_path, capsys):
    from lmstack.cli import main

    out = tmp_path / "a.json"
    assert (
        main(
            [
                "bench",
                "attention",
                "--seq",
                "32,64",
                "--heads",
                "2",
                "--head-dim",
                "16",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert {r["backend"] for r in rows} == {"reference", "sdpa", "flash_pytorch"} and len(rows) == 6
    assert all(r["median_ms"] > 0 and r["peak_mib"] > 0 for r in rows)
    out = tmp_path / "m.json"
    assert (
        main(
            [
                "bench",
                "model",
                "--preset",
                "smollm2-135m",
                "--n-layers",
                "1",
                "--batch",
                "1",
                "--seq",
                "16",
                "--repeats",
                "2",
                "--attn-backend",
                "flash_pytorch",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert [p["phase"] for p in res["phases"]] == ["forward", "backward", "optimizer", "step"]
    assert res["attn_backend"] == "flash_pytorch" and res["peak_memory_mib"] > 0
    text = capsys.readouterr().out
    assert "forward" in text and "flash_pytorch" in text
