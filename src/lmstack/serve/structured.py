"""Structured output: ``response_format`` json_object / json_schema by grammar-constrained decoding.

Book of LLMs §2.6 (sampling is a distribution we may reshape before drawing). The JSON schema is
compiled to a grammar by llguidance (the Rust library behind Guidance, maintained, one wheel with
no dependencies that runs on any CPU); at every step its matcher gives the set of tokens that keep
the output a valid prefix, and the processor sets every other logit to -inf before the sampler
(``SamplingParams.logits_processors``, one matcher per request). Once the JSON is complete only EOS
is allowed, so the output always parses and validates (unless max_tokens cuts it short:
finish_reason "length", as with OpenAI). Whitespace between tokens is not allowed (compact
JSON), so a model cannot wander into endless spaces.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import Tensor

from lmstack.utils import import_extra

llguidance = import_extra("llguidance", "structured", "structured output (response_format)")

JSON_OPTIONS = {"whitespace_flexible": False}


class _Wrapped:
    """What ``llguidance.LLTokenizer`` reads from a tokenizer: the bytes of every id (special
    tokens marked with a leading 0xff, as llguidance expects, so they never count as text), EOS,
    and an encoder."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        specials = set(getattr(tokenizer, "special_tokens", {}).values())
        vocab = tokenizer.vocab  # ids the model has beyond the tokenizer's are empty (never text)
        self.tokens = [
            b"\xff" + vocab.get(i, b"") if i in specials else vocab.get(i, b"")
            for i in range(vocab_size)
        ]
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(specials)
        self._tokenizer = tokenizer
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return list(self._tokenizer.encode(text, allow_special=False))


class Grammars:
    """The server's one llguidance tokenizer; ``processor(schema)`` makes a request's mask."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        if eos_token_id is None:
            raise ValueError("structured output needs an EOS token to end the JSON")
        self.vocab_size, self.eos = vocab_size, eos_token_id
        # the JSON slices: the mask's precomputed token groups, made for JSON strings
        self.lltok = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Wrapped(tokenizer, vocab_size, eos_token_id)),
            n_vocab=vocab_size,
            eos_token=eos_token_id,
            slices=llguidance.LLTokenizer.json_slices(),
        )

    def grammar(self, schema: dict | None) -> str:
        """None = any JSON object (json_object); else the schema (json_schema)."""
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise ValueError(f"the JSON schema must be an object, got {type(schema).__name__}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_OPTIONS
        )
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.lltok
        )
        if is_error:
            raise ValueError(
                f"the JSON schema cannot be compiled: {messages[0] if messages else 'unknown error'}"
            )
        return grammar

    def processor(self, schema: dict | None) -> GrammarMask:
        """A request's mask, its first step computed now: a schema that compiles but fails at the first step (a
        huge repetition, a self-requiring ``$ref``) or admits no JSON value at all (``{"$ref": "#"}``: only the
        empty output) is a ValueError here (the server's 400), not a 500 mid-generation or an empty 200."""
        mask = GrammarMask(
            llguidance.LLMatcher(self.lltok, self.grammar(schema), log_level=0), self.vocab_size
        )
        try:
            first = mask.allowed([])
        except ValueError as e:
            raise ValueError(f"the JSON schema cannot be used: {e}") from None
        text = first.copy()
        text[self.eos] = False
        if not text.any():
            raise ValueError(
                "the JSON schema admits no JSON value (e.g. a $ref that only refers to itself)"
            )
        return mask


class GrammarMask:
    """``(output ids, logits (V,)) -> logits (V,)``: tokens the grammar forbids get -inf."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.V, self.seen = matcher, vocab_size, 0

    def allowed(self, output_ids: list[int]) -> np.ndarray:
        """Advance the matcher over the tokens sampled since the last call -> allowed (V,) bool."""
        new = output_ids[self.seen :]
        if new:
            self.matcher.consume_tokens(list(new))
            self.seen = len(output_ids)
        if self.matcher.is_error():
            raise ValueError(
                f"structured output: the grammar matcher failed: {self.matcher.get_error()}"
            )
        bits = np.frombuffer(
            self.matcher.compute_bitmask(), dtype=np.uint8
        )  # 32-bit words, little-endian
        return np.unpackbits(bits, bitorder="little")[: self.V].astype(bool)

    def __call__(self, output_ids: list[int], logits: Tensor) -> Tensor:
        allowed = torch.from_numpy(self.allowed(output_ids)).to(logits.device)
        return logits.masked_fill(~allowed, -torch.inf)
