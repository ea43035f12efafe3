"""lmstack.align.data: chat-template tokenisation (against transformers' apply_chat_template), the response
mask, packing (a packed batch computes each document's own log-probs), JSONL rows named by line."""

import json
import sys
from pathlib import Path

import pytest
import torch

from lmstack.align.data import (
    DataError,
    Example,
    collate,
    encode_example,
    pack,
    read_preferences,
    response_mask,
)
from lmstack.align.logprobs import batch_logprobs

sys.path.insert(0, str(Path(__file__).parent))
from align_helpers import CHATML, byte_chat_tokenizer, tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "inference"))
from inference_helpers import hf_render_chat  # noqa: E402


def test_example_is_the_rendered_conversation_split_at_the_generation_prompt():
    tok = byte_chat_tokenizer()
    ex = encode_example(tok, "What is 2+3?", "5")
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    prompt_text = hf_render_chat(CHATML, msgs, add_generation_prompt=True)
    full_text = hf_render_chat(
        CHATML, msgs + [{"role": "assistant", "content": "5"}], add_generation_prompt=False
    )
    assert tok.decode(ex.prompt) == prompt_text  # what the engine is given when it generates
    assert tok.decode(ex.prompt + ex.response) == full_text
    assert ex.response == [ord("5"), tok.eos_token_id, ord("\n")]  # the reply, <|im_end|>, newline


def test_labels_are_shifted_with_prompt_and_padding_masked():
    batch = collate([Example([1, 2, 3], [4, 5]), Example([6], [7])], pad_id=0)
    assert batch.x.tolist() == [[1, 2, 3, 4], [6, 0, 0, 0]]
    assert batch.y.tolist() == [[-100, -100, 4, 5], [7, -100, -100, -100]]
    assert response_mask(batch).sum().item() == 3


def test_prompt_longer_than_the_context_and_empty_response_are_refused():
    tok = byte_chat_tokenizer()
    with pytest.raises(
        DataError, match="the prompt has 39 tokens, which leaves no room .* context of 30 tokens"
    ):
        encode_example(tok, "x" * 20, "y", max_len=30)
    ex = encode_example(tok, "hi", "a long answer", max_len=25)
    assert ex.truncated and len(ex) == 25
    with pytest.raises(DataError, match="response is empty"):
        encode_example(tok, "hi", "", chat=False)


def test_packed_rows_give_each_document_its_own_logprobs():
    """Attention stays inside each document and positions restart: the per-token log-probs of a packed row
    equal those of each example run alone (the ``document_ids`` seam); without them they would not."""
    g = torch.Generator().manual_seed(0)
    exs = [
        Example(
            torch.randint(0, 250, (p,), generator=g).tolist(),
            torch.randint(0, 250, (r,), generator=g).tolist(),
        )
        for p, r in [(5, 4), (3, 7), (6, 2), (2, 3)]
    ]
    model = tiny_model().eval()
    batch, members = pack(exs, seq_len=24)
    assert len(members) < len(exs)  # some rows do hold several documents
    with torch.no_grad():
        packed, _ = batch_logprobs(model, batch)
        for r, row in enumerate(members):
            at = 0
            for i in row:
                alone, _ = batch_logprobs(model, collate([exs[i]]))
                n = alone.shape[1]
                torch.testing.assert_close(packed[r, at : at + n], alone[0], rtol=1e-5, atol=1e-5)
                assert batch.positions[r, at : at + n].tolist() == list(range(n))
                at += n
        leaky = batch_logprobs(model, type(batch)(batch.x, batch.y))[
            0
        ]  # no document ids, no restarts
        assert not torch.allclose(leaky, packed, atol=1e-3)


def test_preference_rows_malformed_named_by_line(tmp_path):
    p = tmp_path / "pairs.jsonl"
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    p.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert len(read_preferences(p)) == 2
    for line, message in [
        ("{not json", r"pairs.jsonl:2: not valid JSON"),
        (json.dumps({"prompt": "q", "chosen": "a"}), r"pairs.jsonl:2: missing \['rejected'\]"),
        (json.dumps(good | {"chosen": 3}), r"pairs.jsonl:2: chosen=3 must be a string"),
        (json.dumps(good | {"rejected": " "}), r"pairs.jsonl:2: rejected is empty"),
        ("[1, 2]", r"pairs.jsonl:2: expected a JSON object"),
    ]:
        p.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(DataError, match=message):
            read_preferences(p)
