"""tokenizer_config.json (HF's home of the chat template and the special tokens) both ways, against transformers."""

import pytest

from lmstack.tokenizer import Tokenizer, load_tokenizer, save_hf, save_hf_config

transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _tok():
    tok = Tokenizer(
        {i: bytes([i]) for i in range(256)}, [], special_tokens=["<|im_start|>", "<|im_end|>"]
    )
    tok.chat_template, tok.eos_token_id = TEMPLATE, tok.special_tokens["<|im_end|>"]
    return tok


def test_transformers_reads_what_lmstack_writes(tmp_path):
    save_hf(_tok(), tmp_path / "tokenizer.json")
    save_hf_config(_tok(), tmp_path / "tokenizer_config.json")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert hf.chat_template == TEMPLATE and hf.eos_token == "<|im_end|>"


def test_lmstack_reads_what_transformers_writes(tmp_path):
    save_hf(_tok(), tmp_path / "src.json")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "src.json"), eos_token="<|im_end|>", chat_template=TEMPLATE
    )
    hf.save_pretrained(tmp_path / "hf")
    tok = load_tokenizer(tmp_path / "hf")
    assert tok.chat_template == TEMPLATE and tok.eos_token_id == 257
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "hf" / name).unlink(missing_ok=True)
    assert (
        load_tokenizer(tmp_path / "hf").chat_template is None
    )  # as before: tokenizer.json alone has none
