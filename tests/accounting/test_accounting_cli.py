"""`lmstack plan`: tables, --json, --plot, models from files."""

import json

import pytest

from lmstack.cli import main
from lmstack.model.config import ModelConfig


def test_plan_llama2_13b_prints_seed_table(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "--model",
            "llama2-13b",
            "--hardware",
            "h100",
            "--batch",
            "1,64,256",
            "--seq",
            "1024",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for s in (
        "13,015,449,600",
        "26,869,760,000",
        "79,717,990,400",
        "240,779,264,000",
        "0.0080",
        "0.0238",
        "0.0719",
        "124.6755",
        "2689.4807",
        "3561.7685",
        "ridge 295",
    ):
        assert s in text
    plan = json.loads(out_json.read_text())
    assert [d["memory_bytes"] for d in plan["decode"]] == [
        26_869_760_000,
        79_717_990_400,
        240_779_264_000,
    ]
    assert plan["params"]["total"] == 13_015_864_320
    assert plan["workload"] == {
        "batches": [1, 64, 256],
        "S": 1024,
        "dtype": "bf16",
        "bytes_per_element": 2,
    }


def test_plan_plot_and_lmstack_json_model(tmp_path, capsys):
    cfg = ModelConfig.from_preset("smollm2-135m")
    path = tmp_path / "cfg.json"
    cfg.save(path)
    png = tmp_path / "roofline.png"
    assert (
        main(
            [
                "plan",
                "--model",
                str(path),
                "--hardware",
                "a100-40gb",
                "--batch",
                "1,8",
                "--seq",
                "512",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "134,515,008" in capsys.readouterr().out


def test_plan_from_hf_config_json(tmp_path, capsys):
    # Llama-2-7B's public config.json (the fields that matter).
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "torch_dtype": "float16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                "--model",
                str(path),
                "--hardware",
                "h200",
                "--batch",
                "1",
                "--seq",
                "4096",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["params"]["total"] == 6_738_415_616


def test_plan_cpu_quick(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "smollm2-135m",
                "--hardware",
                "cpu",
                "--quick",
                "--batch",
                "1",
                "--seq",
                "64",
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    assert "cpu" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--model", "gpt-9"], "neither a preset"),
        (["--model", "llama2-7b", "--hardware", "tpu"], "unknown hardware"),
        (["--model", "llama2-7b", "--batch", "1,x"], "--batch '1,x'"),
        (["--model", "llama2-7b", "--dtype", "fp64"], "dtype='fp64'"),
        (["--model", "llama2-7b", "--hardware", "a100", "--dtype", "fp8"], "no peak FLOP/s"),
    ],
)
def test_plan_bad_input(argv, msg, capsys):
    assert main(["plan", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_plan_mfu_from_step_time(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                "--model",
                "llama2-7b",
                "--hardware",
                "h100",
                "--batch",
                "1",
                "--seq",
                "2048",
                "--devices",
                "8",
                "--train-batch",
                "32",
                "--step-time",
                "4.0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    tr = json.loads(out.read_text())["training_per_device"]
    # hand: 3 × forward of 32 sequences of 2048 tokens / (4 s × 8 × 989.4e12)
    D, F, L, V, S = 4096, 11008, 32, 32000, 2048
    fwd = L * (8 * S * D * D + 4 * S * S * D + 6 * S * D * F) + 2 * S * D * V
    assert tr["mfu"] == pytest.approx(3 * 32 * fwd / (4.0 * 8 * 989.4e12))
    assert "MFU" in capsys.readouterr().out
