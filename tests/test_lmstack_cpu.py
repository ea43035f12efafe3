import json

"""lmstack.cpu: the capability probe (parsed from cpuinfo text, faked with LMSTACK_CPU) and the training
precision it chooses for each kind of CPU, with measurements injected (worked numbers, not this machine's)."""

import warnings

import pytest

from lmstack import cpu
from lmstack.cpu import FAKE_CPUS, CpuFeatures, choose_precision

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse4_2 avx f16c avx2 fma bmi2 sha_ni
processor\t: 1
flags\t\t: fpu only-the-first-cpu-counts
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp bf16 i8mm
CPU implementer\t: 0x41
"""


def test_flags_are_read_from_the_first_cpu_of_x86_and_arm_cpuinfo(tmp_path):
    (tmp_path / "x86").write_text(X86_CPUINFO)
    (tmp_path / "arm").write_text(ARM_CPUINFO)
    x86 = cpu._read_flags(str(tmp_path / "x86"))
    assert {"avx2", "fma", "f16c", "sse4_2"} <= x86 and "only-the-first-cpu-counts" not in x86
    assert "avx512f" not in x86
    arm = cpu._read_flags(str(tmp_path / "arm"))
    assert {"asimd", "asimddp", "bf16", "i8mm"} <= arm
    assert cpu._read_flags(str(tmp_path / "missing")) == frozenset()


def test_capabilities_of_real_parts():
    epyc_rome = CpuFeatures(
        "x86_64", "AVX2", frozenset("fpu vme sse4_2 avx f16c avx2 fma bmi2 sha_ni".split())
    )
    assert epyc_rome.avx2 and not epyc_rome.avx512 and not epyc_rome.native_bf16
    assert FAKE_CPUS["avx512_vnni"].avx512_vnni and not FAKE_CPUS["avx512_vnni"].native_bf16
    assert FAKE_CPUS["avx512"].avx512 and not FAKE_CPUS["avx512"].avx512_vnni
    assert FAKE_CPUS["amx"].native_bf16 and FAKE_CPUS["avx512_bf16"].native_bf16
    assert FAKE_CPUS["neon_bf16"].native_bf16 and not FAKE_CPUS["neon"].native_bf16
    assert (
        not FAKE_CPUS["neon"].avx2 and FAKE_CPUS["neon"].is_arm
    )  # an ARM flag set never reads as x86
    # the same flag names on another architecture do not count (an avx2 'flag' on aarch64 is no AVX2)
    assert not CpuFeatures("aarch64", "DEFAULT", frozenset({"avx2", "fma", "f16c"})).avx2


def test_lmstack_cpu_env_fakes_the_probe_and_names_a_bad_value(monkeypatch):
    monkeypatch.setenv("LMSTACK_CPU", "avx2")
    f = cpu.cpu_features()
    assert f.capability == "AVX2" and f.avx2 and not f.avx512 and f.source == "LMSTACK_CPU=avx2"
    assert "LMSTACK_CPU=avx2" in f.summary()
    monkeypatch.setenv("LMSTACK_CPU", "AMX")  # case-insensitive
    assert cpu.cpu_features().native_bf16
    monkeypatch.setenv("LMSTACK_CPU", "pentium")
    with pytest.raises(ValueError, match=r"LMSTACK_CPU='pentium'; expected one of .*avx2"):
        cpu.cpu_features()
    monkeypatch.delenv("LMSTACK_CPU")
    assert cpu.cpu_features().source == "probed"


def _measured(bf16, fp32):
    calls = []

    def measure(n):
        calls.append(n)
        return {"bf16": bf16, "fp32": fp32}

    return measure, calls


@pytest.mark.parametrize(
    "name, expected",
    [
        ("default", "fp32"),
        ("avx2", "fp32"),
        ("avx2_vnni", "fp32"),
        ("avx512", "fp32"),
        ("avx512_vnni", "fp32"),
        ("neon", "fp32"),
        ("avx512_bf16", "bf16"),
        ("amx", "bf16"),
        ("neon_bf16", "bf16"),
    ],
)
def test_auto_is_bf16_only_on_native_bf16_cpus_that_measure_it_faster(name, expected):
    measure, calls = _measured(bf16=900.0, fp32=150.0)
    c = choose_precision("auto", "cpu", FAKE_CPUS[name], measure=measure)
    assert c.precision == expected
    # no native bf16: decided from the flags alone, nothing is timed (an emulated bf16 matmul is slow)
    assert (calls == []) == (expected == "fp32")
    if expected == "fp32":
        assert "no native bf16" in c.reason


def test_auto_keeps_fp32_when_native_bf16_measures_slower():
    measure, _ = _measured(bf16=40.0, fp32=150.0)
    c = choose_precision("auto", "cpu", FAKE_CPUS["amx"], measure=measure)
    assert c.precision == "fp32" and "40 <= fp32 150" in c.reason


def test_explicit_bf16_on_an_emulating_cpu_warns_with_the_measured_slowdown():
    probed_avx2 = CpuFeatures(
        "x86_64", "AVX2", FAKE_CPUS["avx2"].flags
    )  # source "probed": it measures
    measure, calls = _measured(bf16=0.2, fp32=6.3)  # the figures issue #30 measured on an AVX2 EPYC
    with pytest.warns(RuntimeWarning, match=r"bf16 0\.2 vs fp32 6\.3 GFLOP/s, 31\.5x slower"):
        c = choose_precision("bf16", "cpu", probed_avx2, measure=measure)
    assert c.precision == "bf16" and calls == [128]
    with pytest.warns(
        RuntimeWarning, match="not measured on a faked CPU"
    ):  # LMSTACK_CPU fakes do not time
        choose_precision("bf16", "cpu", FAKE_CPUS["avx2"], measure=measure)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # native bf16 or fp32 as asked: no warning
        assert (
            choose_precision("bf16", "cpu", FAKE_CPUS["amx"], measure=measure).precision == "bf16"
        )
        assert (
            choose_precision("fp32", "cpu", FAKE_CPUS["avx2"], measure=measure).precision == "fp32"
        )


def test_bad_precision_is_named():
    with pytest.raises(
        ValueError, match=r"precision='int3'; expected one of \('auto', 'fp32', 'bf16', 'fp16'\)"
    ):
        choose_precision("int3", "cpu", FAKE_CPUS["avx2"])


def test_trainer_resolves_auto_per_cpu_and_records_it(monkeypatch, tmp_path):
    """TrainConfig's default precision is auto; on a (faked) AVX2 CPU the run trains in fp32 and its config says so."""
    import numpy as np

    from lmstack.train import TrainConfig, Trainer

    ids = np.tile(np.arange(1, 33, dtype=np.uint16), 200)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    (tmp_path / "tokens.bin.json").write_text(
        json.dumps({"n_tokens": len(ids), "dtype": "uint16", "vocab_size": 64})
    )
    kw = dict(
        model=dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64),
        train_data=str(path),
        batch_size=2,
        seq_len=16,
        max_steps=2,
        warmup_steps=1,
        device="cpu",
        eval_interval=0,
        eval_batches=1,
    )
    assert TrainConfig(**kw, out_dir=str(tmp_path / "x")).precision == "auto"
    monkeypatch.setenv("LMSTACK_CPU", "avx2")
    t = Trainer(TrainConfig(**kw, out_dir=str(tmp_path / "a")), progress=False)
    assert t.config.precision == "fp32" and t.runtime.dtype == "fp32"
    assert "no native bf16" in t.precision_choice.reason
