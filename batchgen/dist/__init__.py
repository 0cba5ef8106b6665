"""Multi-process building blocks (placeholder docstring, rewritten below)."""

from batchgen.dist.comm import Comm
from batchgen.dist.ep_moe import ExpertParallelMoE
from batchgen.dist.errors import DistConfigError, WorkerLost
from batchgen.dist.failure import Heartbeat
from batchgen.dist.groups import InstanceGroup, instance_groups, instance_ranks
from batchgen.dist.launch import DistContext, DistEnv, WorkerResult, check_procs, init_distributed, launch
from batchgen.dist.placement import ExpertPlacement

__all__ = ["Comm", "DistConfigError", "DistContext", "DistEnv", "ExpertParallelMoE", "ExpertPlacement",
           "Heartbeat", "InstanceGroup", "WorkerLost", "WorkerResult", "check_procs", "init_distributed",
           "instance_groups", "instance_ranks", "launch"]
