"""Regional compilation of a decode step: one graph of one transformer block, or of ``group`` consecutive
blocks, shared by every layer (group) of the same structure and called directly after its first call (the
PyTorch recipe for repeated blocks; CS336 notes "推理流程": decode is memory-bound, everything but the weight
reads is overhead).

What is compiled is ``_layers``: for each block of the group one ``Block.forward`` (``_layer``) for B
single-token rows over a ``PagedDecodeSeam``, whose attention is ``paged_attention.decode_attention`` over that
layer's K/V pool (NB, bs, K, H) read in place through a table (B, M) of block ids — lmstack's C++ kernel
(``paged_kernel``, a custom op in the graph, reading each row's slots 0 .. p_b only), or with the kernel off the
torch formula's indirect loads fused into the score and output loops — with this step's k, v put at slot p_b.
The graph returns the group's output and each layer's k, v of this step; the caller stores them for every layer
at once after the forward. The blocks' weights are inputs of the graph, so groups of identical blocks share it:
``block_signature`` (module types, tensor paths, shapes and dtypes, scalar attributes such as a per-layer window)
tells which blocks may.

``BlockGraphs.forward(tokens, positions, table)`` runs the step: the embedding eagerly, each group through its
compiled graph, the final norm and unembedding eagerly (three ops). After its first call a graph is called
directly with the next group's tensors (no Dynamo guard walk per call), checked once against Dynamo's own
call on a second group (``_check_direct``); from then on a step's loop is a list of direct calls
(``_plan``). Two users: the engine's ``DecodeStep`` (the paged pool, B and M padded to buckets; one block a
graph, as it compiles a graph per bucket) and the batch-1 ``StaticDecoder`` (a ``StaticKVCache`` laid out as a
pool, one fixed table; 5 blocks a graph). Inductor's FX graph cache (on by default, on disk) makes a second
process's compilations much faster.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lmstack.inference import paged_kernel
from lmstack.inference.paged_attention import decode_attention
from lmstack.model.seam import AttentionMetadata

# Inductor options for a decode step: a C++ wrapper calls the kernels of one step instead of Python, and no
# per-call shape asserts (shapes are static). Measured on SmolLM2-135M int4, one CPU thread, whole-model
# graph: 48 -> 62 tokens/s against the default Python wrapper.
COMPILE_OPTIONS = {"cpp_wrapper": True, "size_asserts": False}


def reserve_rope_tables(model, n: int) -> None:
    """Build every RoPE table the model reads (``Transformer.ropes``) for positions 0 .. n−1 now: a compiled
    step reads them and cannot grow them, and building them at its first call would change them (a
    recompile)."""
    p = next(model.parameters())
    compute = torch.float64 if p.dtype == torch.float64 else torch.float32
    for rope in model.ropes():
        rope.reserve(n)
        rope.tables(p.device, compute)


class PagedDecodeSeam:
    """The attention seam of one block in the compiled decode step: q (B, N, 1, H), k, v (B, K, 1, H).

    Holds that layer's pool rows (codes and scales for a quantised pool), the table (B, M) and positions (B,);
    ``attend`` keeps this step's k, v (B, K, H) in ``k_new``/``v_new`` and returns
    ``decode_attention`` over the blocks read in place (module docstring). The layer index the model
    passes is not read: the pool rows are the layer's, so every block traces the same graph."""

    def __init__(self, k_pool, v_pool, k_scale, v_scale, table, positions, abilities):
        self.k_pool, self.v_pool, self.k_scale, self.v_scale = k_pool, v_pool, k_scale, v_scale
        self.table, self.positions, self.abilities = table, positions, abilities
        self.k_new: Tensor | None = None
        self.v_new: Tensor | None = None
        self.q: Tensor | None = None

    def attend(self, layer_idx, q, k, v, meta, impl) -> Tensor:
        self.k_new, self.v_new = k[:, :, 0], v[:, :, 0]  # (B, K, H)
        # returned by the graph too, so inductor stores q once instead of recomputing its RoPE inside the
        # attention's loops for every key slot (measured: 2.3 -> 0.6 ms a layer at 16 rows, 256 slots)
        self.q = q
        return decode_attention(
            q,
            self.k_pool,
            self.v_pool,
            self.table,
            self.positions,
            self.k_new,
            self.v_new,
            window=meta.window,
            softcap=meta.softcap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )


def _tensors(obj, path: str, out: dict[str, Tensor], seen: set[int], depth: int = 0) -> None:
    """Every tensor reachable from a module's attributes (parameters, buffers, fused weights kept in tuples,
    RoPE tables), by attribute path: how a captured block graph finds the same input in another block."""
    if isinstance(obj, Tensor):
        out.setdefault(path, obj)
        return
    if depth > 12 or id(obj) in seen:
        return
    seen.add(id(obj))
    items: Iterable[tuple[Any, Any]]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, torch.nn.Module) or hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return
    for name, value in items:
        _tensors(value, f"{path}.{name}", out, seen, depth + 1)


def block_tensors(block) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    _tensors(block, "", out, set())
    return out


def block_signature(block) -> tuple:
    """Blocks with equal signatures share one graph: module types, every tensor's path, shape and dtype, and
    every scalar attribute (a per-layer window, soft-cap or flag is a constant of the traced graph) but
    ``layer_idx``, which the compiled seam does not read."""
    scalars = tuple(
        (name, k, v)
        for name, m in block.named_modules()
        for k, v in vars(m).items()
        if isinstance(v, (int, float, bool, str, type(None))) and k != "layer_idx"
    )
    tensors = tuple((p, tuple(t.shape), t.dtype) for p, t in block_tensors(block).items())
    return tuple(type(m).__name__ for m in block.modules()) + scalars + tensors


def _layer(block, x, tokens, positions, table, k_pool, v_pool, k_scale, v_scale, window, abilities):
    """One block's decode forward: x (B, 1, D) -> (B, 1, D), k, v (B, K, H), and q (B, N, 1, H), an output
    only so that it is stored once (``PagedDecodeSeam.attend``)."""
    seam = PagedDecodeSeam(k_pool, v_pool, k_scale, v_scale, table, positions, abilities)
    meta = AttentionMetadata(positions[:, None], window=window, cache=seam, token_ids=tokens)
    y = block(x, meta)
    return y, seam.k_new, seam.v_new, seam.q


def _layers(blocks, x, tokens, positions, table, pools, window, abilities):
    """The compiled region: consecutive blocks (a tuple) one after another, ``pools`` their (k_pool, v_pool,
    k_scale, v_scale) each -> (x, then k, v, q of each block)."""
    out: list = []
    for block, pool in zip(blocks, pools):
        x, k, v, q = _layer(block, x, tokens, positions, table, *pool, window, abilities)
        out += (k, v, q)
    return (x, *out)


class BlockGraphs:
    """The compiled blocks of a decode step over one K/V pool per layer (module docstring).

    ``pool(i)``: layer i's (K pool, V pool (NB, bs, K, H), K scales, V scales (NB, K) or None), the same
    tensors at every step; ``abilities``: what the seam declares (the cache's); ``options``: inductor's;
    ``direct=False`` keeps Dynamo's guarded call for every block (a reference). ``group``: consecutive blocks
    per graph (the last group may be shorter): fewer calls a step (each costs ~20 µs of Python and handle
    conversion on a fast core, several times that on a slow one) for a graph ``group`` times larger to
    compile. Graphs are keyed by (B, M, the group's block structures); ``graphs`` counts the compilations (a
    warm step makes no more)."""

    def __init__(
        self,
        model,
        pool: Callable[[int], tuple],
        abilities,
        options: dict,
        direct: bool = True,
        group: int = 1,
    ):
        if group < 1:
            raise ValueError(f"group={group}: blocks per graph must be at least 1")
        if getattr(model, "embed", None) is None or getattr(model, "norm", None) is None:
            raise ValueError(
                "compile=True: the compiled decode step needs a whole Transformer (embed, "
                "blocks, norm); got a model without an embedding or final norm"
            )
        paged_kernel.selected()  # built (or refused) before tracing: the graph reads the choice
        self.model, self.pool, self.abilities = model, pool, abilities
        self.options, self.direct = options, direct
        self.window = model.config.sliding_window
        # after the RoPE tables exist (``reserve_rope_tables``): a layer's own RoPE is its tensor
        self.blocks = list(model.blocks)
        # each distinct signature as a small int: a graph key is hashed per layer per step, and
        # hashing the signature tuple itself cost ~0.5 ms a step (30 layers, two lookups each)
        ids: dict[tuple, int] = {}
        layer_sigs = [ids.setdefault(block_signature(b), len(ids)) for b in self.blocks]
        # groups of ``group`` consecutive layers; each group's signature is its members' (again a small int)
        self.groups = [
            tuple(range(i, min(i + group, len(self.blocks))))
            for i in range(0, len(self.blocks), group)
        ]
        gids: dict[tuple, int] = {}
        self.signatures = [
            gids.setdefault(tuple(layer_sigs[i] for i in g), len(gids)) for g in self.groups
        ]
        # a group's tensors by "[j]" + the attribute path in its j-th block
        self._block_tensors = [
            {
                f"[{j}]{p}": t
                for j, i in enumerate(g)
                for p, t in block_tensors(self.blocks[i]).items()
            }
            for g in self.groups
        ]
        self._steps: dict[tuple, object] = {}  # (B, M, group signature) -> compiled group
        self._direct: dict[tuple, tuple | None] = {}  # same key -> (graph, input recipe) or None
        self._templates: dict[
            tuple, tuple
        ] = {}  # (key, layer) -> the graph's inputs, per-step holes
        self._unboxed: dict[
            tuple, object
        ] = {}  # key -> the wrapped graph (``_check_direct``'s fallback)
        self._plans: dict[tuple, list] = {}  # (B, M) -> the warm loop's calls (``_plan``)
        self._graphs: list[
            tuple
        ] = []  # filled by the _Inductor backend: (graph, example inputs, number of outputs)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    def _compiled_block(self, key: tuple):
        if key not in self._steps:
            # one code object per (bucket, group structure): each keeps its own single graph in Dynamo's cache
            code = _layers.__code__.replace(
                co_name=f"_decode_layer_{len(self._steps)}_{id(self):x}"
            )
            self._steps[key] = torch.compile(
                types.FunctionType(code, globals()),
                fullgraph=True,
                dynamic=False,
                backend=_Inductor(self, self.options, inner=True),
            )
        return self._steps[key]

    def _pools(self, i: int) -> tuple:
        """Group i's layers' pool rows, each a (k_pool, v_pool, k_scale, v_scale)."""
        return tuple(self.pool(n) for n in self.groups[i])

    def _capture(self, key: tuple, i: int, args: tuple) -> None:
        """The graph just compiled for group i: record where each of its inputs comes from (one of the
        step's tensors x, tokens, positions, table; the layers' pool rows, flattened after them; a tensor
        of a block by attribute path; or a constant shared by all groups)."""
        graph, inputs, _ = self._graphs[-1]
        by_id = {id(t): p for p, t in self._block_tensors[i].items()}
        recipe: list[tuple[str, Any]] = []
        for t in inputs:
            j = next((j for j, a in enumerate(args) if a is t), None)
            if j is not None:
                recipe.append(("arg", j))
            elif id(t) in by_id:
                recipe.append(("block", by_id[id(t)]))
            elif isinstance(t, Tensor):
                recipe.append(("const", t))
            else:
                self._direct[key] = None  # a symbolic or non-tensor input: keep Dynamo's call
                return
        # inductor's own entry where its inputs are Dynamo's (called with one list: no AOT runtime wrapper,
        # no CompiledFxGraph.__call__), else the function under Dynamo's disable wrapper (no eval-frame
        # switch per call: we are not tracing); ``_check_direct`` falls back from the first to the second
        inner = inner_graph(graph, inputs)
        wrapped = getattr(graph, "__wrapped__", graph)
        self._direct[key] = (inner, recipe, True) if inner is not None else (wrapped, recipe, False)
        self._unboxed[key] = wrapped

    def _template(self, key: tuple, i: int) -> tuple[list, list[tuple[int, int]]]:
        """Group i's inputs of the captured graph with the per-step ones (x, tokens, positions, table)
        left as holes: (inputs, [(input index, argument index)]), built once per (bucket, group)."""
        t = self._templates.get((key, i))
        if t is None:
            _, recipe, _ = self._direct[key]  # type: ignore[misc]
            static = (None,) * 4 + sum(self._pools(i), ())
            tensors = self._block_tensors[i]
            inputs = [
                static[r] if kind == "arg" else tensors[r] if kind == "block" else r
                for kind, r in recipe
            ]
            holes = [(n, r) for n, (kind, r) in enumerate(recipe) if kind == "arg" and r < 4]
            t = self._templates[(key, i)] = (inputs, holes)
        return t

    def _direct_call(self, key: tuple, i: int, step: tuple) -> tuple:
        fn, _, boxed = self._direct[key]  # type: ignore[misc]
        inputs, holes = self._template(key, i)
        args = list(inputs)
        for n, r in holes:
            args[n] = step[r]
        return fn(args) if boxed else fn(*args)

    def _call(self, fn, i: int, x, tokens, positions, table):
        """Dynamo's call of group i's compiled function."""
        blocks = tuple(self.blocks[n] for n in self.groups[i])
        return fn(blocks, x, tokens, positions, table, self._pools(i), self.window, self.abilities)

    def _run_group(self, i: int, B: int, M: int, x, tokens, positions, table):
        key = (B, M, self.signatures[i])
        direct = self._direct.get(key, False)
        if direct:
            return self._direct_call(key, i, (x, tokens, positions, table))
        args = (x, tokens, positions, table, *sum(self._pools(i), ()))
        fn = self._compiled_block(key)
        n_before = len(self._graphs)
        out = self._call(fn, i, x, tokens, positions, table)
        if (
            direct is False
            and self.direct
            and len(self._graphs) == n_before + 1
            and self._graphs[-1][2] == 1 + 3 * len(self.groups[i])
        ):
            self._capture(key, i, args)
            self._check_direct(key, i + 1, x, tokens, positions, table)
        elif direct is False:
            self._direct[key] = None
        return out

    def _check_direct(self, key: tuple, j: int, x, tokens, positions, table) -> None:
        """Call group j (the next one of this structure; the one just compiled, j − 1, if it has no other)
        both ways once: the direct call must give Dynamo's result exactly (else inductor's entry gives way
        to the wrapped graph, and that to Dynamo's guarded call)."""
        if not self._direct.get(key):
            return
        j = next((n for n in range(j, len(self.groups)) if self.signatures[n] == key[2]), j - 1)
        ref = self._call(self._compiled_block(key), j, x, tokens, positions, table)
        while self._direct[key]:
            try:
                got = self._direct_call(key, j, (x, tokens, positions, table))
            except Exception:  # noqa: BLE001 — a way of calling it that does not work: the next one
                got = ()
            if len(ref) == len(got) and all(map(torch.equal, ref, got)):
                return
            _, recipe, boxed = self._direct[key]  # type: ignore[misc]
            self._direct[key] = (self._unboxed[key], recipe, False) if boxed else None

    def _plan(self, B: int, M: int) -> list | None:
        """Once every group's graph of bucket (B, M) is called directly: per group (function, its inputs
        with holes, the holes, called with one list?), so a step's loop does no lookups."""
        plan = self._plans.get((B, M))
        if plan is None:
            keys = [(B, M, sig) for sig in self.signatures]
            if not all(self._direct.get(key) for key in keys):
                return None
            plan = self._plans[(B, M)] = [
                (self._direct[key][0], *self._template(key, i), self._direct[key][2])  # type: ignore[index]
                for i, key in enumerate(keys)
            ]
        return plan

    def forward(self, tokens: Tensor, positions: Tensor, table: Tensor):
        """tokens (B, 1), positions (B,), table (B, M) -> logits (B, V), this step's k, v (L, B, K, H) each
        (not stored: the caller writes them into its pools)."""
        model = self.model
        B, M = table.shape
        x = model.embed(tokens)  # (B, 1, D)
        if model.config.embed_scale:  # Gemma: W_e[tokens]·√D, as Transformer.forward
            x = x * torch.tensor(model.config.d_model**0.5, dtype=x.dtype)
        ks, vs = [], []
        plan = self._plan(B, M)
        if plan is not None:  # the warm path: each group's graph called directly, nothing looked up
            for fn, inputs, holes, boxed in plan:
                args = list(inputs)
                step = (x, tokens, positions, table)
                for n, r in holes:
                    args[n] = step[r]
                out = fn(args) if boxed else fn(*args)
                x = out[0]
                ks += out[1::3]
                vs += out[2::3]
        else:
            for i in range(len(self.groups)):
                out = self._run_group(i, B, M, x, tokens, positions, table)
                x = out[0]
                ks += out[1::3]
                vs += out[2::3]
        logits = model.unembed(model.norm(x))[:, -1]  # (B, V)
        return logits, torch.stack(ks), torch.stack(vs)


class _Inductor:
    """Dynamo's backend for a ``StaticDecoder``'s whole-model step or a ``BlockGraphs`` block: Inductor with its
    options, appending (graph, the tensors it was traced with, number of outputs) to the owner's ``_graphs``. Dynamo keeps its backends
    for the life of the process, so this holds the decoder only weakly (the decoder, its model and cache
    are freed with the last other reference). ``inner``: keep inductor's compiled graph and its inputs'
    shapes on the returned function, for ``inner_graph``."""

    def __init__(self, decoder, options: dict, inner: bool = False):
        self.decoder, self.options, self.inner = weakref.ref(decoder), options, inner

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        inputs = list(example_inputs)  # before compile_fx, which may consume the list
        outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        if not self.inner:
            graph = compile_fx(gm, example_inputs, config_patches=self.options)
        else:
            from torch._inductor.compile_fx import compile_fx_inner

            found: list = []

            def inner_compile(
                gm_, inputs_, **kw
            ):  # keeps inductor's compiled graph (``inner_graph``)
                out = compile_fx_inner(gm_, inputs_, **kw)
                found.append((out, [(tuple(t.shape), t.dtype) for t in inputs_]))
                return out

            # AOT's own cache would skip inner_compile (inductor's FX graph cache still answers inside it)
            with torch._functorch.config.patch(enable_autograd_cache=False):
                graph = compile_fx(
                    gm, example_inputs, inner_compile=inner_compile, config_patches=self.options
                )
            if len(found) == 1:
                graph._lmstack_inner = found[0]
        decoder = self.decoder()
        if decoder is not None:
            decoder._graphs.append(
                (graph, inputs, len(outputs) if isinstance(outputs, (list, tuple)) else 1)
            )
        return graph


def inner_graph(graph, inputs: list) -> object | None:
    """The function inside a graph ``_Inductor`` compiled that runs inductor's code (with ``cpp_wrapper``,
    the generated module's entry: it takes one list of the inputs and empties it), skipping the AOT runtime
    wrapper and ``CompiledFxGraph.__call__`` (Python around every call); None where its inputs are not
    Dynamo's (``inputs``) one for one by shape and dtype (AOT added or removed some). A caller checks its
    output against the whole graph's once before relying on it."""
    found = getattr(graph, "_lmstack_inner", None)
    if found is None:
        return None
    code, shapes = found
    want = [(tuple(t.shape), t.dtype) if isinstance(t, Tensor) else None for t in inputs]
    fn = getattr(code, "current_callable", None)
    plain = getattr(code, "_boxed_call", False) and not getattr(code, "mutated_inputs", True)
    return fn if fn is not None and plain and shapes == want else None
