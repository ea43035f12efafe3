"""``lmstack parallel``: look at a plan without launching it.

    lmstack parallel bubble --pp 4 --micro-batches 8     # GPipe / 1F1B / zero-bubble schedules and bubbles
    lmstack parallel mesh --world 8 --tp 2 --pp 2        # which rank holds which (pp, dp, cp, tp) coordinate
    lmstack parallel mesh --world 8 --tp 2 --ep 2        # ... and which expert shard (ep = dp mod ep)

Training itself runs through ``torchrun --nproc_per_node=N -m lmstack.train --config run.toml
parallel=ddp`` (docs/parallel.md).
"""

from __future__ import annotations

import argparse

from lmstack.parallel.mesh import DeviceMesh
from lmstack.parallel.pipeline import bubble_formula, schedule, simulate


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "parallel",
        help="pipeline schedules/bubbles and device-mesh layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    b = sub.add_parser("bubble", help="print pipeline schedules and bubble fractions")
    b.add_argument("--pp", type=int, default=4, help="pipeline stages p")
    b.add_argument("--micro-batches", "-m", type=int, default=8, help="micro-batches m")
    b.add_argument("--show", action="store_true", help="print each stage's action order")
    b.set_defaults(func=run_bubble)
    m = sub.add_parser("mesh", help="print the rank layout of a plan")
    m.add_argument("--world", type=int, required=True)
    for axis in ("tp", "pp", "cp", "ep"):
        m.add_argument(f"--{axis}", type=int, default=1)
    m.set_defaults(func=run_mesh)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def run_bubble(args) -> int:
    p, m = args.pp, args.micro_batches
    print(f"p={p} stages, m={m} micro-batches; formula (p-1)/(m+p-1) = {bubble_formula(p, m):.3f}")
    for kind in ("gpipe", "1f1b", "zb"):
        orders = schedule(kind, p, m)
        sim = simulate(orders)
        print(
            f"  {kind:5s} bubble {sim['bubble']:.3f}  makespan {sim['makespan']:.0f} units "
            f"(F=1, {'B=W=1' if kind == 'zb' else 'B=2'})"
        )
        if args.show:
            for s, o in enumerate(orders):
                print(f"    stage {s}: " + " ".join(f"{k}{i}" for k, i in o))
    return 0


def run_mesh(args) -> int:
    ep = getattr(args, "ep", 1)
    model = args.tp * args.pp * args.cp * ep
    if args.world % model:
        raise ValueError(f"world={args.world} is not divisible by tp·pp·cp·ep = {model}")
    mesh = DeviceMesh(dp=args.world // model * ep, tp=args.tp, pp=args.pp, cp=args.cp, ep=ep)
    print(
        f"{mesh}: tp fastest (one node), pp slowest"
        + (f"; ep coordinate = dp mod {ep}" if ep > 1 else "")
    )
    for r in range(args.world):
        c = mesh.coords(r)
        line = f"  rank {r:3d}: pp={c['pp']} dp={c['dp']} cp={c['cp']} tp={c['tp']}"
        print(line + (f" ep={c['dp'] % ep}" if ep > 1 else ""))
    return 0
