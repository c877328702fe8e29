"""The data of a cluster search: a configuration, its predicted score, and the ranked result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fxpipe.errors import ConfigError
from fxpipe.partitioner.cluster import ClusterSpec
from fxpipe.schema import NonNegFloat, NonNegInt, PositiveInt, read_dataclass

__all__ = ["Configuration", "ConfigurationScore", "Alternative", "SearchResult"]


@dataclass(frozen=True)
class Configuration:
    """How to run one training step on the cluster (Note [cluster search] in ``search``)."""

    stages: PositiveInt  # pipeline ranks S
    replicas: PositiveInt  # data-parallel replicas R
    microbatches: PositiveInt  # M per replica per step
    microbatch_size: PositiveInt  # samples per microbatch
    schedule: str
    virtual_stages: PositiveInt = 1  # stages per rank
    shard: str = "none"
    recompute: tuple[bool, ...] = ()  # per stage (S x V of them): recompute activations in backward

    @property
    def devices(self) -> int:
        return self.stages * self.replicas

    @property
    def label(self) -> str:
        v = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        rc = sum(self.recompute)
        recompute = f", recompute {rc}/{len(self.recompute)} stages" if rc else ""
        return (
            f"S={self.stages} x R={self.replicas}, M={self.microbatches} x {self.microbatch_size}, "
            f"{self.schedule}{v}, shard {self.shard}{recompute}"
        )


@dataclass(frozen=True)
class ConfigurationScore:
    """A configuration's predicted step: its time, throughput, bubble, memory and what limits it."""

    config: Configuration
    step_ms: NonNegFloat
    samples_per_s: NonNegFloat
    pipeline_ms: NonNegFloat  # the simulated forward/backward part of the step
    bubble: NonNegFloat  # idle share of the pipeline part
    peak_memory_bytes: NonNegInt  # the fullest device
    dp_ms: NonNegFloat  # the slowest stage's data-parallel collectives
    recompute_ms: NonNegFloat  # extra forward time per step on the busiest rank
    limit: str  # what limits it, in words
    assignment: tuple[NonNegInt, ...] = ()


@dataclass(frozen=True)
class Alternative:
    """Why the best of one group of configurations (``group``: pipeline depth, schedule or
    sharding level; ``value``: which) loses to the best, or why none of it could run."""

    group: str
    value: str
    step_ms: NonNegFloat | None
    note: str


@dataclass(frozen=True)
class SearchResult:
    """The ranked configurations (best first), and ``alternatives`` for ``--explain``."""

    cluster: ClusterSpec
    global_batch: PositiveInt
    optimizer: str
    ranked: tuple[ConfigurationScore, ...]
    alternatives: tuple[Alternative, ...]
    candidates: NonNegInt
    priced: NonNegInt
    simulated: NonNegInt
    seconds: NonNegFloat
    # the job's own cost-model fields every configuration was priced with (Note [what the job
    # prices] in fxpipe.partitioner.search.configurations)
    cost_fields: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> ConfigurationScore:
        return self.ranked[0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SearchResult:
        return read_dataclass(cls, d, "cluster search", ConfigError)
