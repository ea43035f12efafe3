"""Chat templates vs transformers' renderer; ``lmstack generate`` / ``lmstack chat`` on a small
random model saved as a checkpoint with a tokenizer (the real model is in test_smollm2_inference)."""

import io

import pytest
from inference_helpers import hf_render_chat

from lmstack.tokenizer import ChatTemplateError, Tokenizer, render_chat_template

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.mark.parametrize("template", [CHATML, LLAMA2], ids=["chatml", "llama2"])
@pytest.mark.parametrize("conv", [0, 1])
@pytest.mark.parametrize("gen", [True, False])
def test_render_matches_transformers(template, conv, gen):
    messages = CONVERSATIONS[conv]
    if template is LLAMA2:
        messages = [m for m in messages if m["role"] != "system"]
    ref = hf_render_chat(template, messages, gen, bos_token="<s>", eos_token="</s>")
    assert render_chat_template(template, messages, gen, bos_token="<s>", eos_token="</s>") == ref


def test_template_errors():
    with pytest.raises(ChatTemplateError, match="alternate"):
        render_chat_template(LLAMA2, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        render_chat_template(CHATML, [{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="parse"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])

    no_template = Tokenizer({i: bytes([i]) for i in range(256)}, [])  # chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


class Args:
    """argparse-like namespace for run_chat."""

    def __init__(self, **kw):
        self.__dict__.update(
            dict(
                model="m",
                max_tokens=5,
                temperature=0.0,
                top_k=None,
                top_p=None,
                min_p=0.0,
                repetition_penalty=1.0,
                seed=0,
                dtype="fp32",
                tokenizer=None,
                system=None,
            )
            | kw
        )


def test_cli_generate_and_chat_on_a_saved_checkpoint(tmp_path, capsys):
    """A random model + a trained tokenizer saved to disk, driven through the real CLI entry point."""
    import torch
    from inference_helpers import full_recompute_greedy, make_model

    from lmstack.cli import main
    from lmstack.inference.cli import run_chat
    from lmstack.model.io import save_pretrained
    from lmstack.tokenizer import Tokenizer, save_hf, train_bpe

    (tmp_path / "corpus.txt").write_text("hello world, hello chat. " * 20)
    specials = ["<|im_start|>", "<|im_end|>"]
    vocab, merges = train_bpe(
        tmp_path / "corpus.txt", vocab_size=300, special_tokens=specials, progress=False
    )
    tok = Tokenizer(vocab, merges, specials)
    model = make_model(vocab_size=300, dtype=torch.float32)
    save_pretrained(model, tmp_path / "ckpt")
    save_hf(tok, tmp_path / "ckpt" / "tokenizer.json")
    assert (
        main(
            [
                "generate",
                "--model",
                str(tmp_path / "ckpt"),
                "--prompt",
                "hello",
                "--max-tokens",
                "6",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    from lmstack.tokenizer import load_tokenizer

    tok = load_tokenizer(tmp_path / "ckpt")
    expected = tok.decode(full_recompute_greedy(model, tok.encode("hello"), 6))
    assert out.out == "hello" + expected + "\n" and "tokens/s decode" in out.err

    tok.chat_template = CHATML
    stdin = io.StringIO("hi\nagain\n/exit\nnever read\n")
    buf = io.StringIO()
    assert run_chat(Args(model=str(tmp_path / "ckpt")), stdin=stdin, out=buf, tokenizer=tok) == 0
    first = tok.decode(
        full_recompute_greedy(
            model,
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": "hi"}], add_generation_prompt=True
                )
            ),
            5,
        )
    )
    assert buf.getvalue().startswith(first + "\n")
    assert buf.getvalue().count("\n") == 2
    spec = io.StringIO()  # prompt-lookup speculation changes the speed, not the greedy text
    assert (
        run_chat(
            Args(model=str(tmp_path / "ckpt"), speculative_tokens=3),
            stdin=io.StringIO("hi\nagain\n"),
            out=spec,
            tokenizer=tok,
        )
        == 0
    )
    assert spec.getvalue() == buf.getvalue()


def test_llm_and_the_cli_load_through_the_same_checks(tmp_path, capsys):
    """``LLM(path)`` and ``lmstack generate`` share one loader: the checkpoint's own tokenizer by default,
    and a tokenizer with more ids than the model's vocabulary refused by both."""
    import torch
    from inference_helpers import make_model

    from lmstack.cli import main
    from lmstack.inference import LLM
    from lmstack.model.io import save_pretrained
    from lmstack.tokenizer import Tokenizer, save_hf

    small = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    model = make_model(vocab_size=256, dtype=torch.float32)
    save_pretrained(model, tmp_path / "ckpt")
    save_hf(small, tmp_path / "ckpt" / "tokenizer.json")
    assert LLM(str(tmp_path / "ckpt")).tokenizer.vocab == small.vocab
    big = Tokenizer(
        {i: bytes([i]) for i in range(256)}, [], special_tokens=["<|extra|>"]
    )  # V = 257 > 256
    save_hf(big, tmp_path / "big.json")
    with pytest.raises(ValueError, match="257 tokens but the model's vocabulary has 256"):
        LLM(str(tmp_path / "ckpt"), tokenizer=str(tmp_path / "big.json"))
    with pytest.raises(ValueError, match="257 tokens"):
        LLM(model, tokenizer=big)
    assert (
        main(
            [
                "generate",
                "--model",
                str(tmp_path / "ckpt"),
                "--tokenizer",
                str(tmp_path / "big.json"),
                "--prompt",
                "hi",
            ]
        )
        == 2
    )
    assert "257 tokens but the model's vocabulary has 256" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_generate_quantized_and_llm_quant(tmp_path, capsys):
    """``--quant int8`` / ``--dtype int4`` and ``LLM(quant=...)``: the output is the greedy output of
    the model quantised with lmstack.quant (checked by a full recompute of that model)."""
    import copy

    import torch
    from inference_helpers import full_recompute_greedy, make_model

    from lmstack.cli import main
    from lmstack.inference import LLM, SamplingParams
    from lmstack.inference.loader import weight_format
    from lmstack.model.io import save_pretrained
    from lmstack.quant import Int8Linear, quantize_model
    from lmstack.tokenizer import Tokenizer, save_hf, train_bpe

    (tmp_path / "corpus.txt").write_text("hello world, hello chat. " * 20)
    vocab, merges = train_bpe(tmp_path / "corpus.txt", vocab_size=300, progress=False)
    tok = Tokenizer(vocab, merges)
    model = make_model(vocab_size=len(vocab), dtype=torch.float32, init_std=0.2)
    save_pretrained(model, tmp_path / "ckpt")
    save_hf(tok, tmp_path / "ckpt" / "tokenizer.json")
    prompt = tok.encode("hello")
    # 5 tokens: the int4 model's 6th is a near tie (top-2 gap 0.016 against logits of ~5; its activations are
    # rounded to int8, so any change of summation order can flip it — the eager static decoder picks the other
    # token there, as the regional compiled step does, while the full recompute and the whole-model graph agree)
    for flags, method in (
        (["--quant", "int8"], "int8"),
        (["--dtype", "int4", "--compile"], "int4"),
    ):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    str(tmp_path / "ckpt"),
                    "--prompt",
                    "hello",
                    "--max-tokens",
                    "5",
                    *flags,
                ]
            )
            == 0
        )
        expected = tok.decode(
            full_recompute_greedy(quantize_model(copy.deepcopy(model), method), prompt, 5)
        )
        assert capsys.readouterr().out == "hello" + expected + "\n"
    llm = LLM(str(tmp_path / "ckpt"), quant="int8")
    assert isinstance(llm.engine.model.blocks[0].attn.q_proj, Int8Linear)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.token_ids == full_recompute_greedy(
        quantize_model(copy.deepcopy(model), "int8"), prompt, 6
    )
    # the number format is a runtime choice: RuntimeConfig(dtype=...) is what quant= stands for
    from lmstack.kernels import RuntimeConfig

    llm = LLM(str(tmp_path / "ckpt"), runtime=RuntimeConfig(dtype="int8"))
    assert (
        isinstance(llm.engine.model.blocks[0].attn.q_proj, Int8Linear)
        and llm.runtime.dtype == "int8"
    )
    assert (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].token_ids
        == out.token_ids
    )
    with pytest.raises(ValueError, match="disagree"):
        LLM(str(tmp_path / "ckpt"), runtime=RuntimeConfig(dtype="int4"), quant="int8")
    with pytest.raises(ValueError, match="dtype='int3'"):
        RuntimeConfig(dtype="int3")
    assert weight_format("bf16", "int8") == (torch.bfloat16, "int8")
    with pytest.raises(ValueError, match="conflicts"):
        weight_format("int8", "int4")
