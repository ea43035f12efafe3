"""The paged engine honours the configured attention backend through the seam: with every CPU
implementation it gives the full-recompute greedy tokens, grouped or one masked attention."""

import pytest
from inference_helpers import full_recompute_greedy, make_model

from lmstack.inference import LLM, SamplingParams
from lmstack.kernels import RuntimeConfig
from lmstack.kernels.backends import attention_impl

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [full_recompute_greedy(model, p, GREEDY.max_tokens) for p in prompts]


class Spy:
    """An implementation that counts its calls and delegates to a registered one."""

    def __init__(self, name):
        self.inner, self.name, self.calls = attention_impl(name), name, 0

    def __call__(self, q, k, v, meta):
        self.calls += 1
        return self.inner(q, k, v, meta)


# flash_*: every paged call carries an explicit mask (cache slots), so they hand it to sdpa (kernels.backends);
# flash_triton therefore needs no Triton here.
@pytest.mark.parametrize("selective", [True, False], ids=["grouped", "one-masked"])
@pytest.mark.parametrize(
    "backend", ["sdpa", "reference", "matmul", "flash_pytorch", "flash_triton"]
)
def test_engine_with_each_backend_equals_full_recompute(backend, selective, prompts, reference):
    model = make_model()  # the fixture's weights, its own implementation
    llm = LLM(
        model,
        runtime=RuntimeConfig(attn_backend=backend),
        block_size=4,
        num_blocks=200,
        max_num_batched_tokens=9,
        max_num_seqs=6,
        selective=selective,
    )
    assert llm.runtime_line.startswith(f"attention: {backend} (configured)")
    spy = Spy(backend)
    model.set_attention(spy)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert (
        spy.calls >= llm.engine.stats["forwards"] * model.config.n_layers
    )  # every layer, every forward
