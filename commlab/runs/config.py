"""One run configuration: the settings that determine a measurement, their defaults and columns.

Pure and torch-free: the measurement harness (commlab.sweep) and the cost model both speak it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from commlab.runs.optimizers import DEFAULT as DEFAULT_OPTIMIZER
from commlab.runs.options import parse_model_args
from commlab.runs.zero_stage import ZeroStage, parse_stage

# Option -> default. The embedded default (no options but --bucket-mb) is the README's first
# command: CPU, Gloo, world size 2, the built-in MLP, with and without overlap.
DEFAULTS: dict[str, Any] = {
    "model": "mlp",
    "model_args": "",
    "bucket_mb": "25",
    "backend": "gloo",
    "world_size": "2",
    "algorithm": "native",
    "overlap": "both",
    "accumulate": "1",
    "groups": "1",
    # Threads per rank are fixed, not cpu_count // world_size (commlab.launch's default): that
    # gave world size 1 twice the compute of world size 2 on a 2-core machine, so strong-scaling
    # efficiency came out far above 1 (26). One thread per rank keeps compute per rank equal
    # across world sizes and fits the default grid on a 2-core laptop; --threads 1,2 sweeps it.
    "threads": "1",
    "scaling": "strong",
    "global_batch": 64,
    "batch_per_rank": None,
    # 20 measured steps keep the default grid (6 configurations) near a minute on a 2-core
    # machine (60 took 2 min 6 s, 30 took 81 s: each configuration also pays ~6 s of spawn,
    # import and warm-up); the reference spec measures 60 with --repeat 3.
    "iters": 20,
    "warmup": 3,
    "repeat": 1,
    "out": "results",
    "name": None,
    "launcher": "local",
    "timeout": 300.0,
    "nnodes": 1,
    "rdzv_endpoint": None,
    # A bucket policy's name (commlab/ddp/policy.py) or package.module:Class; a spec-file key.
    "bucket_policy": "size_cap",
    # Sharded data parallelism (commlab.ShardedDataParallel): stage 0 is commlab's DDP; prefetch
    # and reshard (stage 3's reshard_after_forward) mean something at stage 3 only.
    "stage": "0",
    "prefetch": "1",
    "reshard": "on",
    # None: Adam when the grid has a stage 1-3 (stage 1 shards the optimizer state, and plain SGD
    # has none), plain SGD for a DDP-only grid (as every DDP result before it): optimizer_default.
    "optimizer": None,
    # Tensor- and pipeline-parallel sizes; the data-parallel size is the rest of the world size
    # (world_size / (tp * pp)), or --dp names it and the world size is the product.
    "tp": "1",
    "pp": "1",
    "dp": None,
    # Pipeline micro-batches per step (None: 2 x pp, enough for 1F1B to reach its steady state)
    # and the schedule (commlab.pipeline's registry); both mean something with pp > 1 only.
    "microbatches": None,
    "schedule": "1f1b",
    # Hybrid sharding (stages 1-3): ranks per shard group, replicas across the groups; 0, the
    # default, shards over the whole data-parallel group.
    "shard_group": "0",
}
# The configuration fields added after results existed, with the value every older record holds;
# left out of the id at that value, so older results keep their ids (and --resume them).
LATER_FIELDS: dict[str, Any] = {"bucket_policy": DEFAULTS["bucket_policy"], "stage": 0, "prefetch": 1, "reshard": True,
                                "optim": DEFAULT_OPTIMIZER, "tp": 1, "pp": 1,
                                "microbatches": 1, "schedule": "1f1b", "shard_group": 0}
LAUNCHERS = ("local", "torchrun")
SCALINGS = ("strong", "weak")


@dataclass(frozen=True)
class Config:
    """One point of the grid: everything that determines a DDP measurement."""

    model: str
    model_args: str  # canonical "key=value,..." (sorted keys)
    backend: str
    world_size: int
    bucket_mb: float
    algorithm: str
    overlap: bool
    accumulate: int  # micro-batches per optimizer step; all but the last under no_sync
    groups: int  # round-robin process groups
    threads: int  # torch intra-op threads per rank, the same at every world size
    scaling: str
    global_batch: int  # samples per micro-batch across all ranks
    batch_per_rank: int
    iters: int
    warmup: int
    bucket_policy: str = DEFAULTS["bucket_policy"]
    stage: int = 0  # 0: commlab DDP; 1-3: ShardedDataParallel's ZeRO stage
    prefetch: int = 1  # stage 3's all-gathers ahead of use (1 at other stages)
    reshard: bool = True  # stage 3's reshard_after_forward (True at other stages)
    # the optimizer (a name of commlab/runs/optimizers.py; set by --optimizer): not "optimizer",
    # which every iteration table has as the optimizer step's seconds
    optim: str = DEFAULT_OPTIMIZER
    tp: int = 1  # tensor-parallel group size (innermost: ranks r and r + 1 share a group)
    pp: int = 1  # pipeline stages
    microbatches: int = 1  # pipeline micro-batches per step (1 with one stage)
    schedule: str = "1f1b"  # the pipeline's schedule (a name of commlab.pipeline's registry)
    shard_group: int = 0  # stages 1-3: ranks per shard group (hybrid sharding); 0: the whole dp group

    @property
    def dp(self) -> int:
        """The data-parallel size: the ranks that hold the same model part (tp * pp * dp = world size)."""
        return self.world_size // (self.tp * self.pp)

    @property
    def shard(self) -> int:
        """Ranks a parameter is sharded over: the shard group (hybrid sharding), else every
        data-parallel rank."""
        return self.shard_group or self.dp

    @property
    def replicas(self) -> int:
        """Shard groups holding the same shards (1 without hybrid sharding)."""
        return self.dp // self.shard

    @property
    def zero_stage(self) -> ZeroStage:
        """What :attr:`stage` shards (stage 0: nothing, commlab's DDP)."""
        return parse_stage(self.stage)

    @property
    def id(self) -> str:
        """Readable and stable: the same settings give the same id in every run (used by --resume).
        Fields added later are left out at their old value (:data:`LATER_FIELDS`), so ids are those
        of runs made before they were options."""
        settings = {k: v for k, v in asdict(self).items() if k not in LATER_FIELDS or v != LATER_FIELDS[k]}
        digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:6]
        model = re.sub(r"[^A-Za-z0-9]+", "_", self.model)[:24]
        overlap = "ov" if self.overlap else "noov"
        policy = "" if "bucket_policy" not in settings else "-" + re.sub(r"[^A-Za-z0-9]+", "_", self.bucket_policy)[:24]
        sharded = "" if not self.stage else f"-s{self.stage}" + (
            f"-p{self.prefetch}-{'rs' if self.reshard else 'nors'}" if self.stage == 3 else "")
        optimizer = "" if "optim" not in settings else f"-{self.optim}"
        layout = "" if self.tp == self.pp == 1 else f"-tp{self.tp}-pp{self.pp}-dp{self.dp}"
        layout += f"-m{self.microbatches}-{self.schedule}" if self.pp > 1 else ""
        layout += f"-hs{self.shard_group}" if self.shard_group else ""
        return (
            f"{model}-{self.backend}-w{self.world_size}-b{self.bucket_mb:g}-{self.algorithm}-"
            f"{overlap}-a{self.accumulate}-g{self.groups}-t{self.threads}{policy}{sharded}{optimizer}{layout}-{digest}"
        )

    def columns(self) -> dict[str, Any]:
        """The configuration columns of every results table, ``config`` (the id) first."""
        return {"config": self.id, **asdict(self)}

    def model_kwargs(self) -> dict[str, Any]:
        return parse_model_args(self.model_args)

    @classmethod
    def from_columns(cls, row: dict[str, Any]) -> Config:
        # Results written before a later field was a column hold its old value's runs.
        values = {f.name: row[f.name] for f in fields(cls) if f.name in row or f.name not in LATER_FIELDS}
        if "reshard" in values:  # a CSV or YAML may give it as text
            values["reshard"] = str(values["reshard"]).lower() in ("true", "1", "on")
        return cls(**values)


def zero_stage_of(cfg: Config | dict[str, Any]) -> ZeroStage:
    """What a configuration shards: a Config, or a record's configuration as a dict (one written
    before stages were a column is DDP's)."""
    default = LATER_FIELDS["stage"]
    return parse_stage(cfg.get("stage", default) if isinstance(cfg, dict) else getattr(cfg, "stage", default))


def optimizer_of(cfg: Config | dict[str, Any]) -> str:
    """The optimizer a configuration trains with (one recorded before it was a column: plain SGD)."""
    default = LATER_FIELDS["optim"]
    return str(cfg.get("optim", default) if isinstance(cfg, dict) else getattr(cfg, "optim", default))


def optimizer_default(stages: list[int]) -> str:
    """The optimizer of a grid that names none: Adam when it has a stage 1-3, so that sharding the
    optimizer state saves something; plain SGD for DDP alone, so that DDP results stay comparable
    with every DDP result before the option."""
    return "adam" if any(int(s) >= 1 for s in stages) else DEFAULT_OPTIMIZER


CONFIG_COLUMNS = ["config", *(f.name for f in fields(Config))]
