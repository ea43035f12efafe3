"""``lmstack scaling``: ``plan`` (compute-optimal N, D, loss for a budget), ``sweep`` (train the IsoFLOP
grid of a sweep file into runs.jsonl, resumable) and ``fit`` (Chinchilla's approaches 1-3 with intervals,
the held-out prediction, PNG figures). CS336 notes "规模定律", Book of LLMs §3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lmstack.accounting import get_hardware
from lmstack.scaling.coord_check import SITES, coord_check, plot_coord_check
from lmstack.scaling.experiments import batch_sweep, lr_transfer, plot_batch_sweep, plot_lr_transfer
from lmstack.scaling.fit_runs import fit_runs
from lmstack.scaling.planner import PRESETS, Law, compute_from_hardware, compute_optimal
from lmstack.scaling.runs import read_runs
from lmstack.scaling.sweep import Sweep, run_sweep
from lmstack.threads import add_threads_argument
from lmstack.utils import (
    atomic_write_text,
    check_outputs,
    finite_float,
    is_json_file,
    is_png_file,
    own_folder_kind,
    positive_int,
    unit_interval,
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "scaling", help="scaling laws: compute-optimal planner, IsoFLOP sweep, Chinchilla fits"
    )
    sub = p.add_subparsers(title="scaling commands", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 0)[1])

    pl = sub.add_parser(
        "plan", help="N_opt, D_opt, tokens/parameter and predicted loss for a compute budget"
    )
    pl.add_argument(
        "--flops",
        type=finite_float,
        action="append",
        help="compute budget C in FLOPs (repeatable; beside --gpus/--hours both budgets are planned)",
    )
    pl.add_argument(
        "--gpus",
        type=positive_int,
        help="a budget from hardware (with --flops: planned as one more budget): number of devices ...",
    )
    pl.add_argument("--hours", type=finite_float, help="... for this many hours ...")
    pl.add_argument(
        "--hardware", default="h100", help="... of this accounting/hardware entry (default h100)"
    )
    pl.add_argument(
        "--mfu", type=float, default=0.4, help="... at this model FLOPs utilisation (default 0.4)"
    )
    pl.add_argument("--dtype", default="bf16", help="dtype for the peak FLOP/s (default bf16)")
    pl.add_argument(
        "--law",
        default="all",
        help="chinchilla | epoch | chinchilla-approach1 | all (default) | a fit.json",
    )
    pl.set_defaults(func=cmd_plan)

    sw = sub.add_parser(
        "sweep",
        help="train the IsoFLOP grid of a sweep file (resumable: finished runs are skipped)",
    )
    sw.add_argument("--config", required=True, help="sweep TOML (see configs/scaling/sweep.toml)")
    sw.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    sw.add_argument("--limit", type=int, default=None, help="train at most this many runs now")
    sw.add_argument(
        "--force",
        action="store_true",
        help="write into the sweep's out_dir even when it holds files of something else",
    )
    add_threads_argument(
        sw, help="CPU threads for training (default: the CPUs available to this process)"
    )
    sw.set_defaults(func=cmd_sweep)

    ft = sub.add_parser(
        "fit", help="fit approaches 1-3 to a runs.jsonl, predict the held-out run, write PNGs"
    )
    ft.add_argument("runs", help="runs.jsonl written by `lmstack scaling sweep`")
    ft.add_argument(
        "--out",
        default=None,
        help="folder for fit.json and the PNGs (default: beside the runs file)",
    )
    ft.add_argument(
        "--bootstrap",
        type=int,
        default=100,
        help="bootstrap resamples for the intervals (default 100)",
    )
    ft.add_argument("--level", type=unit_interval, default=0.9, help="interval level (default 0.9)")
    ft.add_argument(
        "--window",
        type=float,
        default=None,
        help="approach 2: fit each IsoFLOP parabola to the sizes within this factor of the budget's "
        "best run (default: all sizes)",
    )
    ft.add_argument(
        "--repeats",
        choices=["auto", "none", "muennighoff", "fit"],
        default="auto",
        help="approach 3 for runs that repeat their data: none (D as trained), muennighoff (D' with "
        "R* = 15.4), fit (D' with R* fitted), auto (default: the lowest backtest error — fit all "
        "budgets but the largest, predict the largest)",
    )
    ft.add_argument(
        "--unique-tokens",
        type=float,
        default=None,
        help="U, the unique training tokens, for rows that do not record unique_tokens",
    )
    ft.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds files of something else",
    )
    add_threads_argument(ft)
    ft.set_defaults(func=cmd_fit)

    cc = sub.add_parser(
        "coord-check", help="µP coordinate check: activation size vs width at steps 0-5, SP and µP"
    )
    cc.add_argument(
        "--widths",
        default="32,64,128,256",
        help="comma-separated d_model values (default 32,64,128,256)",
    )
    cc.add_argument("--base-width", type=int, default=32, help="µP base width (default 32)")
    cc.add_argument("--steps", type=int, default=5)
    cc.add_argument("--lr", type=float, default=1e-2)
    cc.add_argument("--out", default="runs/scaling-mup/coord_check.png", help="PNG path")
    add_threads_argument(cc)
    cc.set_defaults(func=cmd_coord_check)

    lt = sub.add_parser(
        "lr-transfer", help="loss vs learning rate for several widths under SP and µP"
    )
    lt.add_argument("--data", required=True, help="token file (lmstack tokenizer encode)")
    lt.add_argument("--widths", default="32,64,128")
    lt.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1")
    lt.add_argument("--base-width", type=int, default=32)
    lt.add_argument("--steps", type=int, default=150)
    lt.add_argument(
        "--out", default="runs/scaling-mup", help="folder for the runs, lr_transfer.json/.png"
    )
    lt.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds files of something else",
    )
    add_threads_argument(lt)
    lt.set_defaults(func=cmd_lr_transfer)

    bs = sub.add_parser(
        "batch-sweep", help="loss vs steps at several batch sizes, with the gradient noise scale"
    )
    bs.add_argument("--data", required=True, help="token file (lmstack tokenizer encode)")
    bs.add_argument("--batches", default="2,8,32", help="sequences per step (default 2,8,32)")
    bs.add_argument("--steps", type=int, default=200)
    bs.add_argument("--width", type=int, default=64)
    bs.add_argument(
        "--out", default="runs/scaling-batch", help="folder for the runs, batch_sweep.json/.png"
    )
    bs.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it holds files of something else",
    )
    add_threads_argument(bs)
    bs.set_defaults(func=cmd_batch_sweep)


def _laws(spec: str):

    if spec == "all":
        return list(PRESETS.values())
    if spec in PRESETS:
        return [PRESETS[spec]]
    path = Path(spec)
    if path.is_file():
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--law {spec}: not a JSON fit file ({e})") from None
        approaches = d.get("approaches") if isinstance(d, dict) else None
        if not isinstance(approaches, dict):
            raise ValueError(
                f"--law {spec}: expected a `lmstack scaling fit` fit.json (an object with "
                f"'approaches'), got {type(d).__name__} {json.dumps(d)[:60]}"
            )
        for a in approaches.values():
            if isinstance(a, dict) and "law" in a:
                return [Law.from_params(a["law"], name=f"fit ({path})")]
        raise ValueError(f"--law {spec}: the fit file holds no L(N, D) law (approach 3 failed?)")
    raise ValueError(
        f"--law {spec!r}: expected chinchilla, epoch, chinchilla-approach1, all, or a fit.json path"
    )


def cmd_plan(args) -> int:

    budgets = list(args.flops or [])
    if args.gpus is not None or args.hours is not None:
        if args.gpus is None or args.hours is None:
            raise ValueError("--gpus and --hours go together (devices × hours × peak × --mfu)")

        hw = get_hardware(args.hardware)
        C = compute_from_hardware(args.gpus, args.hours, hw.flops(args.dtype), args.mfu)
        print(
            f"{args.gpus} x {hw.name} x {args.hours:g} h at MFU {args.mfu:.0%} ({args.dtype} peak "
            f"{hw.flops(args.dtype) / 1e12:,.0f} TFLOP/s) -> C = {C:.3g} FLOPs"
        )
        budgets.append(C)
    if not budgets:
        raise ValueError(
            "give a budget: --flops C (repeatable) or --gpus M --hours T [--hardware --mfu]"
        )
    print(
        f"{'law':<22} {'C (FLOPs)':>11} {'N_opt':>11} {'D_opt':>11} {'tokens/param':>13} {'loss':>7}"
    )
    for law in _laws(args.law):
        for C in budgets:
            p = compute_optimal(C, law)
            loss = "-" if math.isnan(p.loss) else f"{p.loss:.3f}"
            print(
                f"{law.name:<22} {C:>11.3g} {p.N:>11.3g} {p.D:>11.3g} {p.tokens_per_param:>13.1f} {loss:>7}"
            )
    return 0


def cmd_sweep(args) -> int:

    sweep = Sweep.load(args.config)
    # the out_dir may hold the sweep's own inputs (they are never written); an interrupted first run
    # leaves its folder before runs.jsonl exists
    data = sweep.train.get("train_data")
    inputs = {Path(f).resolve() for f in (args.config, data, f"{data}.json")}
    what, own = own_folder_kind("scaling sweep", "runs.jsonl", *(s.name for s in sweep.plan()))
    check_outputs(
        [("the sweep's out_dir", sweep.out_dir)],
        [],
        {
            "the sweep's out_dir": (
                what.replace(
                    "an empty folder", "an empty folder, one holding only the sweep's inputs,"
                ),
                lambda p: own(p) or (p.is_dir() and {f.resolve() for f in p.iterdir()} <= inputs),
            )
        },
        force=args.force,
    )
    if args.dry_run:
        specs = sweep.plan()
        for s in specs:
            print(
                f"{s.name:<48} C={s.budget:.2g} N={s.N:>9,} steps={s.steps:>6,} D={s.D:>11,} "
                f"D/N={s.D / s.N:7.1f}"
            )
        print(f"{len(specs)} runs, {sum(6.0 * s.N * s.D for s in specs):.3g} FLOPs (6ND) in all")
        return 0
    trained, skipped = run_sweep(sweep, limit=args.limit)
    diverged = sum(bool(r.get("diverged")) for r in read_runs(sweep.runs_path, missing_ok=True))
    print(
        f"{trained} run(s) trained, {skipped} already finished; results in {sweep.runs_path}"
        + (f" ({diverged} diverged: recorded, left out of the fits)" if diverged else "")
    )
    return 0


def cmd_fit(args) -> int:

    runs = Path(args.runs)
    out = Path(args.out) if args.out else runs.parent / "fit"
    check_outputs(
        [("--out", out), ("--out's fit.json", out / "fit.json")],
        [("the runs file", runs)],
        {
            "--out": own_folder_kind("scaling fit", "fit.json"),
            "--out's fit.json": ("a JSON file", is_json_file),
        },
        force=args.force,
    )
    rows = read_runs(runs)
    res = fit_runs(
        rows,
        out,
        n_boot=args.bootstrap,
        level=args.level,
        window=args.window,
        repeats=args.repeats,
        unique=args.unique_tokens,
    )
    print(
        f"{len(rows)} runs from {runs} ({sum(bool(r.get('holdout')) for r in rows)} held out); "
        f"{args.level:.0%} bootstrap intervals over {args.bootstrap} resamples"
    )
    if res.backtest:
        bt = next(iter(res.backtest.values()))
        print(
            f"backtest (approach 3 fitted on C < {bt['test_budget']:.3g}, predicting the {len(bt['test'])} runs "
            f"at C = {bt['test_budget']:.3g}): mean |error| "
            + ", ".join(f"{k} {v['mean_abs_error']:.2%}" for k, v in res.backtest.items())
        )
    print(f"approach 3 recipe: repeats={res.repeats}")
    print("compute-optimal allocation N_opt ∝ C^a, D_opt ∝ C^b:")
    for a in res.approaches:
        print(f"  {a}")
        if a.law is not None:
            print(f"    {a.law}")
        if a.extra.get("constrained"):
            k = a.extra["constrained"]
            iv = f" [{k['a_ci'][0]:.3f}, {k['a_ci'][1]:.3f}]" if k.get("a_ci") else ""
            pts = ", ".join(f"C={c:.3g}: {n:,.0f}" for c, n in zip(k["C"], k["N_opt"]))
            print(
                f"    with U = {k['U']:,.0f} unique tokens (numerical optimum of the D' law): N_opt {pts}; "
                f"a = {k['a']:.3f}{iv}"
                if k.get("a") is not None
                else f"    with U = {k['U']:,.0f}: N_opt {pts}"
            )
        for c, why in a.extra.get("skipped", {}).items():
            print(f"    warning: budget C={c:.3g} left out: {why}")
        for c in a.extra.get("outside", []):
            print(
                f"    warning: at C={c:.3g} the parabola's minimum lies outside the sizes trained (extrapolated)"
            )
    if res.loss_law is not None:
        print(f"loss on the compute frontier (approach 1's envelope): {res.loss_law}")
    for name, why in res.errors.items():
        print(f"  {name}: not fitted: {why}")
    for h in res.holdout:
        iv = f" [{h['interval'][0]:.4f}, {h['interval'][1]:.4f}]" if h["interval"] else ""
        ivr = (
            f" (one run: [{h['interval_run'][0]:.4f}, {h['interval_run'][1]:.4f}])"
            if h.get("interval_run")
            else ""
        )
        print(
            f"held-out {h['name']}: N={h['N']:,.0f} D={h['D']:,.0f}: predicted {h['predicted']:.4f}{iv}{ivr}, "
            f"actual {h['actual']:.4f}, error {h['error']:+.2%}"
        )
    for d in res.diverged:
        print(f"diverged, left out of the fits: {d['name']} (N={d['N']:,.0f}): {d['diverged']}")
    for f in res.figures:
        print(f"wrote {f}")
    print(f"wrote {out / 'fit.json'}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not v or min(v) < 1:
        raise ValueError(f"{flag} {text!r}: expected positive integers")
    return v


def cmd_coord_check(args) -> int:

    widths = _ints(args.widths, "--widths")
    check_outputs([("--out", args.out)], [], {"--out": ("a PNG image", is_png_file)})
    res = {
        p: coord_check(widths, args.base_width, p, steps=args.steps, lr=args.lr)
        for p in ("sp", "mup")
    }
    print(f"mean |x| at step {args.steps} (lr {args.lr:g}, base width {args.base_width}):")
    print(f"{'':5} {'width':>6} " + " ".join(f"{s:>11}" for s in SITES))
    for p, r in res.items():
        for w in widths:
            print(f"{p:5} {w:>6} " + " ".join(f"{v:>11.4f}" for v in r[w][-1]))
    print(f"wrote {plot_coord_check(res, Path(args.out))}")
    return 0


def cmd_lr_transfer(args) -> int:

    out = Path(args.out)
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lrs {args.lrs!r}: expected comma-separated numbers") from None
    widths = _ints(args.widths, "--widths")
    runs = [f"{p}_w{w}_lr{lr:g}" for p in ("sp", "mup") for w in widths for lr in lrs]
    check_outputs(
        [("--out", out)],
        [("--data", args.data)],
        {"--out": own_folder_kind("scaling lr-transfer", "lr_transfer.json", *runs)},
        force=args.force,
    )
    s = lr_transfer(args.data, out, widths, lrs, args.base_width, steps=args.steps)
    print(f"final validation loss ({args.steps} steps):")
    print(f"{'':5} {'width':>6} " + " ".join(f"{lr:>8g}" for lr in lrs) + "   best lr")
    for p in ("sp", "mup"):
        for w, r in s["results"][p].items():
            print(
                f"{p:5} {w:>6} "
                + " ".join(f"{r[lr]:>8.4f}" for lr in lrs)
                + f"   {s['best_lr'][p][w]:g}"
            )
    atomic_write_text(out / "lr_transfer.json", json.dumps(s, indent=2, default=str) + "\n")
    print(f"wrote {plot_lr_transfer(s, out / 'lr_transfer.png')} and {out / 'lr_transfer.json'}")
    return 0


def cmd_batch_sweep(args) -> int:

    out = Path(args.out)
    batches = _ints(args.batches, "--batches")
    runs = [f"b{b}" for b in batches]
    check_outputs(
        [("--out", out)],
        [("--data", args.data)],
        {"--out": own_folder_kind("scaling batch-sweep", "batch_sweep.json", *runs)},
        force=args.force,
    )
    s = batch_sweep(args.data, out, batches, args.steps, width=args.width)
    for b, pts in sorted(s["curves"].items()):
        print(f"B={b:>4} sequences: final training loss {pts[-1][1]:.4f} after {pts[-1][0]} steps")
    if s["noise_scale"]:
        print(
            f"gradient noise scale B_simple ≈ {s['noise_scale']['b_simple_tokens']:,.0f} tokens "
            f"(≈ {s['noise_scale']['b_simple_tokens'] / s['seq']:,.1f} sequences of {s['seq']})"
        )
    atomic_write_text(out / "batch_sweep.json", json.dumps(s, indent=2, default=str) + "\n")
    print(f"wrote {plot_batch_sweep(s, out / 'batch_sweep.png')} and {out / 'batch_sweep.json'}")
    return 0
