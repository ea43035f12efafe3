"""Suite-wide set-up. Triton kernels are tested twice, each run explicit:

- the interpreter run: this pytest process always runs Triton under ``TRITON_INTERPRET=1``, on
  CPU-only and CUDA machines alike (Triton reads the variable when it is first imported, so it is
  set here, before any test module can import it). Every tests/kernels test that needs the
  interpreter fails — it does not skip — if Triton was imported without it;
- the compiled run: on a machine with a CUDA GPU, ``tests/kernels/test_kernels_cuda.py`` runs
  ``kernel_cuda_check.py`` in a subprocess without the variable (``pytest -m cuda`` selects it;
  with ``LMSTACK_REQUIRE_CUDA=1`` a missing GPU is a failure instead of a skip).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402  (after TRITON_INTERPRET: nothing below may import triton first)
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module whose timings or small kernels suffer from the other core's load
    (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_hf_llama(std: float = 0.1, seed: int = 0, **config):
    """A small random-weight HF ``LlamaForCausalLM`` (eval mode), every weight N(0, std²) — the reference model of
    the HF-parity tests. ``config`` overrides the LlamaConfig defaults below (D=64, L=2, N=4, K=2, F=128, untied)."""
    transformers = pytest.importorskip("transformers", reason="HF transformers is the reference")
    torch.manual_seed(seed)
    kw = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(kw | config))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    return model


@pytest.fixture(scope="session")
def make_hf_llama():
    """``random_hf_llama`` for any test directory (fixtures reach every folder; a module import would not)."""
    return random_hf_llama


@pytest.fixture(scope="session")
def hf_llama_pair(tmp_path_factory):
    """``pair(**config)`` -> (a ``random_hf_llama``, the same weights saved as safetensors and loaded by
    lmstack's loader in fp32, eval mode): the two sides of an HF-parity test."""
    from lmstack.model.io import load_model

    def pair(**config):
        hf = random_hf_llama(**config)
        d = tmp_path_factory.mktemp("hf_llama")
        hf.save_pretrained(d, safe_serialization=True)
        return hf, load_model(str(d), dtype=torch.float32).model.eval()

    return pair


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: the compiled Triton run on a CUDA GPU (a subprocess)")


# Under CI (CI=true) nothing may skip but the compiled CUDA run on a machine without a GPU and the paths a
# CPU feature gates ("the CPU lacks ...": AMX, VNNI, AVX-512; CI's machine changes kind between runs, and
# the dispatch to each path is tested with faked flags on any machine): CI installs every optional package
# and file the suite uses, so any other skip means coverage was lost (a package renamed a module, a file
# moved) and fails the run instead of passing quietly. The phrase is kept for skips whose condition reads
# the real CPU's flags and nothing else.
CI_ALLOWED_SKIPS = ("needs a CUDA GPU", "the CPU lacks")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    lost = [r for r in skipped if not any(ok in _skip_reason(r) for ok in CI_ALLOWED_SKIPS)]
    if lost:
        for r in lost:
            reporter.write_line(f"CI: unexpected skip {r.nodeid}: {_skip_reason(r)}", red=True)
        session.exitstatus = 1
