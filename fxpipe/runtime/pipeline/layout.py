"""``RankLayout``: which global rank runs which stage of which pipeline replica.

Ranks are numbered replica-major: ``rank = replica * num_stages + stage``, so one
pipeline's ranks are neighbours (the same node when a node has at least
``num_stages`` devices, keeping the frequent activation traffic on the fast local
links), and a data-parallel group holds the same stage of every replica. With tensor
parallelism of degree T each (replica, stage) position is T neighbouring ranks, tp innermost:
``rank = (replica * num_stages + stage) * T + tp`` (the mesh ``(dp, pp, tp)``), and each tp
index has its own pipelines and data-parallel groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.errors import RuntimeSetupError

__all__ = ["RankLayout"]


@dataclass(frozen=True)
class RankLayout:
    """``replicas`` copies of a ``num_stages``-rank pipeline over ``num_stages * replicas`` ranks.

    ``num_stages`` counts pipeline ranks: a build with V stages (chunks) per rank has
    ``num_stages = chunks / V`` here, and ``stage_of(rank)`` is the rank's position in its pipeline.

    >>> layout = RankLayout(num_stages=2, replicas=2)
    >>> layout.stage_of(3), layout.replica_of(3), layout.pipeline_ranks(1), layout.data_parallel_ranks(0)
    (1, 1, (2, 3), (0, 2))
    """

    num_stages: int
    replicas: int = 1
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.replicas < 1 or self.tensor_parallel < 1:
            raise RuntimeSetupError(
                f"a rank layout needs >= 1 stage, replica and tp rank, got {self.num_stages} "
                f"stages, {self.replicas} replicas and tp {self.tensor_parallel}"
            )

    @classmethod
    def for_world(
        cls, world_size: int, num_stages: int, virtual_stages: int = 1, tensor_parallel: int = 1
    ) -> RankLayout:
        """The layout for ``world_size`` ranks of a pipeline of ``num_stages`` ranks (each running
        ``virtual_stages`` stages) of ``tensor_parallel`` ranks each; refuses a size that is not a
        multiple of the pipeline's ranks."""
        if tensor_parallel > 1:
            per = num_stages * tensor_parallel
            if world_size < per or world_size % per:
                raise RuntimeSetupError(
                    f"world size {world_size} is not a multiple of {num_stages} pipeline ranks x "
                    f"tp {tensor_parallel} = {per}: launch {per} processes per replica"
                )
            return cls(num_stages, world_size // per, tensor_parallel)
        if world_size < num_stages or world_size % num_stages:
            what = (
                f"{num_stages} stages"
                if virtual_stages == 1
                else f"{num_stages * virtual_stages} stages, {virtual_stages} per rank, on {num_stages} ranks"
            )
            raise RuntimeSetupError(
                f"world size {world_size} does not match the build directory's {what}: "
                f"launch {num_stages} processes (one per pipeline rank), e.g. "
                f"`torchrun --nproc-per-node {num_stages} -m fxpipe.runtime.launch.worker DIR`, "
                f"or repartition with `fxpipe partition --stages {world_size}`"
            )
        return cls(num_stages, world_size // num_stages)

    @property
    def world_size(self) -> int:
        return self.num_stages * self.replicas * self.tensor_parallel

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise RuntimeSetupError(
                f"rank {rank} is outside this layout's world of {self.world_size} ranks"
            )

    def stage_of(self, rank: int) -> int:
        self._check_rank(rank)
        return (rank // self.tensor_parallel) % self.num_stages

    def replica_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // (self.num_stages * self.tensor_parallel)

    def tp_of(self, rank: int) -> int:
        """The rank's index in its tensor-parallel group."""
        self._check_rank(rank)
        return rank % self.tensor_parallel

    def rank_of(self, stage: int, replica: int = 0, tp: int = 0) -> int:
        if not (
            0 <= stage < self.num_stages
            and 0 <= replica < self.replicas
            and 0 <= tp < self.tensor_parallel
        ):
            raise RuntimeSetupError(
                f"stage {stage} / replica {replica} / tp {tp} is outside {self.num_stages} stages "
                f"x {self.replicas} replicas x tp {self.tensor_parallel}"
            )
        return (replica * self.num_stages + stage) * self.tensor_parallel + tp

    def pipeline_ranks(self, replica: int, tp: int = 0) -> tuple[int, ...]:
        """Global ranks of replica ``replica``'s stages (tp index ``tp``), in stage order."""
        return tuple(self.rank_of(s, replica, tp) for s in range(self.num_stages))

    def data_parallel_ranks(self, stage: int, tp: int = 0) -> tuple[int, ...]:
        """Global ranks that hold stage ``stage`` (tp index ``tp``), one per replica."""
        return tuple(self.rank_of(stage, r, tp) for r in range(self.replicas))
