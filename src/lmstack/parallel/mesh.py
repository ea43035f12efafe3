"""A device mesh with named axes built from the world size.

Book of LLMs §6.1 (5D parallelism: DP, TP, PP, SP/CP, EP), §6.3 (the mesh has axes (X, Y); a
tensor dimension written J_Y is sharded along the mesh axis Y, a missing axis means
replicated), CS336 notes "混合并行" (model parallelism — TP/SP/CP/EP — inside one NVLink domain,
PP across domains, DP replicating the whole unit).

Ranks are laid out with ``tp`` fastest, then ``cp``, then ``dp``, then ``pp`` slowest, so the
tensor-parallel group is a block of neighbouring ranks (one node) and the pipeline spans nodes:

    rank = ((pp_i · dp + dp_i) · cp + cp_i) · tp + tp_i

Expert parallelism shares the data-parallel ranks (CS336 notes "专家并行": EP ≤ DP, they share the
weight partition): the ``ep`` groups are blocks of ``ep`` consecutive members of each dp group
(``ep`` coordinate = dp index mod ep), and the ``edp`` groups ("expert data parallel") join the
members of a dp group with the same ``ep`` coordinate — the ranks that hold the same expert shard,
over which its gradients are averaged. Here ``dp`` is the whole data-parallel degree (the batch is
split over it); the plan's ``dp`` with ``ep`` > 1 counts the replicas of one expert shard, so
``mesh.dp = plan.dp · plan.ep`` (``plan.build_mesh``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

AXES = ("pp", "dp", "cp", "tp")  # slowest -> fastest


@dataclass
class DeviceMesh:
    """Named process groups; ``mesh.group("tp")``, ``mesh.rank("dp")``, ``mesh.size("pp")``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    _groups: dict = field(default_factory=dict, repr=False)
    _coords: dict = field(default_factory=dict, repr=False)
    _members: dict = field(default_factory=dict, repr=False)
    _all: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, dp: int | None = None, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1
    ) -> DeviceMesh:
        """Create the groups for this world. ``dp=None`` takes what the other axes leave.
        Every rank must call this with the same arguments (``dist.new_group`` is collective)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call lmstack.parallel.init_distributed() "
                "(or launch with torchrun) before building a mesh"
            )
        world = dist.get_world_size()
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        model = tp * pp * cp
        if dp is None:
            if world % model:
                raise ValueError(
                    f"world size {world} is not divisible by tp·pp·cp = {tp}·{pp}·{cp} = {model}"
                )
            dp = world // model
        if dp * model != world:
            raise ValueError(
                f"dp·tp·pp·cp = {dp}·{tp}·{pp}·{cp} = {dp * model} != world size {world}"
            )
        if dp % ep:
            raise ValueError(
                f"ep={ep} must divide dp={dp} (expert parallelism shares the data-parallel ranks)"
            )
        mesh = cls(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        mesh._make_groups()
        return mesh

    def size(self, axis: str) -> int:
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis == "edp":
            return self.dp // self.ep
        return getattr(self, axis)

    def rank_of(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}

    def _make_groups(self) -> None:
        world = self.dp * self.tp * self.pp * self.cp
        me = dist.get_rank()
        self._coords = self.coords(me)
        self._coords["ep"] = self._coords["dp"] % self.ep
        self._coords["dp_cp"] = self._coords["dp"] * self.cp + self._coords["cp"]
        self._coords["edp"] = self._coords["dp"] // self.ep
        # one group per axis per setting of the other coordinates; every rank creates all of them
        axes = {
            "tp": lambda c: tuple((k, c[k]) for k in ("pp", "dp", "cp")),
            "cp": lambda c: tuple((k, c[k]) for k in ("pp", "dp", "tp")),
            "dp": lambda c: tuple((k, c[k]) for k in ("pp", "cp", "tp")),
            "pp": lambda c: tuple((k, c[k]) for k in ("dp", "cp", "tp")),
            "dp_cp": lambda c: tuple((k, c[k]) for k in ("pp", "tp")),  # gradient sync of DP×CP
            "ep": lambda c: (
                tuple((k, c[k]) for k in ("pp", "cp", "tp")) + (("dp_block", c["dp"] // self.ep),)
            ),
            "edp": lambda c: (
                tuple((k, c[k]) for k in ("pp", "cp", "tp")) + (("ep", c["dp"] % self.ep),)
            ),
        }
        for axis, key in axes.items():
            buckets: dict = {}
            for r in range(world):
                buckets.setdefault(key(self.coords(r)), []).append(r)
            self._all[axis] = [buckets[k] for k in sorted(buckets)]
            for k in sorted(buckets):
                ranks = buckets[k]
                g = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                if me in ranks:
                    self._groups[axis] = g
                    self._members[axis] = ranks

    def group(self, axis: str):
        """The process group of this rank along ``axis`` (dp, tp, pp, cp, ep, edp or dp_cp)."""
        if axis not in self._groups:
            raise KeyError(f"axis={axis!r}; expected one of {sorted(self._groups)}")
        return self._groups[axis]

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self._coords[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        return list(self._members[axis])

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every group's member ranks along ``axis`` (the same list on every rank)."""
        return [list(r) for r in self._all[axis]]

    def __str__(self) -> str:
        return f"DeviceMesh(pp={self.pp}, dp={self.dp}, cp={self.cp}, tp={self.tp}, ep={self.ep})"
