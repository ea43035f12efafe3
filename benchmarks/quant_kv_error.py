"""Where 1-byte KV blocks lose precision on SmolLM2-135M's real keys and values (docs/quant.md, "fp8 KV blocks").

    nice -n 10 python benchmarks/quant_kv_error.py [--tokens 256] [--block 16]

One forward over ``--tokens`` tokens of the GPL-3 licence text fills a contiguous fp32 KV cache; its K and
V are cut into blocks of ``--block`` positions × H per (layer, KV head), the paged pool's blocks. Per format,
the relative error ‖x̂ − x‖ / ‖x‖ over all blocks, quantised once:
int8 (s = max|x|/127), fp8 e4m3 with s = max|x|/448, fp8 e4m3 with a power-of-two s (the pool's rule),
fp8 e5m2 (s = max|x|/57344); for e4m3 the fraction of codes that land in the subnormals (|code| < 2⁻⁶) or
flush to 0; the share of the squared error carried by the 1% largest |x|; and "decode-filled": the
block written one position at a time as the pool does (dequantise, add the row, re-round when the scale
grows), for both fp8 scale rules; and the same errors through lmstack's one KV codec (``quant.kv_codec``, int8
and fp8 quantised once), which should equal the int8 and the e4m3 s=2^k columns. Torch's float8 dtypes do the
e4m3/e5m2 rounding.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lmstack.inference.kv_cache import KVCache
from lmstack.inference.loader import model_tokenizer
from lmstack.model.io import load_model
from lmstack.quant.kv_codec import decode, quantize_blocks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def scale(amax: torch.Tensor, qmax: float, pow2: bool) -> torch.Tensor:
    s = amax / qmax
    return torch.exp2(torch.ceil(torch.log2(s))) if pow2 else s


def once(x: torch.Tensor, fmt: str, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., bs, H) quantised per block -> (dequantised, codes as float)."""
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    if fmt == "int8":
        s = amax / 127
        q = torch.round(x / s).clamp(-127, 127)
    else:
        dt, qmax = (E4M3, 448.0) if fmt == "e4m3" else (E5M2, 57344.0)
        s = scale(amax, qmax, pow2)
        q = (x / s).clamp(-qmax, qmax).to(dt).float()
    return q * s, q


def decode_filled(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    """e4m3 blocks written one position at a time by the pool's rule (scale kept unless the block's max grows)."""
    bs = x.shape[-2]
    codes = torch.zeros_like(x)
    s = torch.zeros(x.shape[:-2] + (1, 1))
    for t in range(bs):
        vals = codes * s
        vals[..., t, :] = x[..., t, :]
        sn = scale(vals[..., : t + 1, :].abs().amax(dim=(-2, -1), keepdim=True), 448.0, pow2)
        s = sn if t == 0 else torch.maximum(s, sn)
        codes = (vals / s).clamp(-448, 448).to(E4M3).float()
    return codes * s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    if args.tokens < args.block or args.tokens % args.block:
        raise SystemExit(
            f"--tokens={args.tokens} must be a positive multiple of --block={args.block}"
        )
    torch.set_num_threads(1)
    lm = load_model("smollm2-135m")
    model = lm.model.eval()
    text = Path("/usr/share/common-licenses/GPL-3")
    if not text.is_file():
        raise SystemExit(f"{text} is missing (the evaluation text of benchmarks/quant_quality.py)")
    ids = torch.tensor(model_tokenizer(lm.source).encode(text.read_text())[: args.tokens])[None]
    if ids.shape[1] < args.tokens:
        raise SystemExit(f"the text has {ids.shape[1]} tokens, fewer than --tokens={args.tokens}")
    cache = KVCache(model.config, 1, args.tokens)
    with torch.inference_mode():
        model(ids, torch.arange(args.tokens)[None], kv_cache=cache)
    print(
        f"SmolLM2-135M K/V of {args.tokens} GPL-3 tokens, blocks of {args.block} positions x H per (layer, KV head)"
    )
    print(
        "| | int8 | e4m3 s=max/448 | e4m3 s=2^k | e5m2 | e4m3 subnormal / flushed | top-1% |x| share of error "
        "(int8, e4m3) | decode-filled e4m3 s=max/448, s=2^k | median block max/rms | codec int8, fp8 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, t in (("K", cache.k), ("V", cache.v)):
        L, B, K, S, H = t.shape  # (L, B, K, S, H)
        x = t.float().reshape(L, B, K, S // args.block, args.block, H)
        rel = lambda xh: float((xh - x).norm() / x.norm())  # noqa: B023, E731
        i8, _ = once(x, "int8")
        e4, c4 = once(x, "e4m3")
        e4p, _ = once(x, "e4m3", pow2=True)
        e5, _ = once(x, "e5m2")
        nz = x != 0
        sub = float(((c4.abs() < 2**-6) & nz).float().mean())
        flushed = float(((c4 == 0) & nz).float().mean())
        big = x.abs() >= x.abs().flatten().kthvalue(int(0.99 * x.numel())).values
        share = [float(((xh - x)[big] ** 2).sum() / ((xh - x) ** 2).sum()) for xh in (i8, e4)]
        ratio = float((x.abs().amax(dim=(-2, -1)) / x.pow(2).mean(dim=(-2, -1)).sqrt()).median())
        codec = [
            decode(c, s[..., None, None])
            for c, s in (quantize_blocks(x, f) for f in ("int8", "fp8"))
        ]
        print(
            f"| {name} | {rel(i8):.4f} | {rel(e4):.4f} | {rel(e4p):.4f} | {rel(e5):.4f} | {sub:.5f} / {flushed:.5f} | "
            f"{share[0]:.2f}, {share[1]:.2f} | {rel(decode_filled(x, False)):.4f}, {rel(decode_filled(x, True)):.4f} | "
            f"{ratio:.1f} | {rel(codec[0]):.4f}, {rel(codec[1]):.4f} |"
        )


if __name__ == "__main__":
    main()
