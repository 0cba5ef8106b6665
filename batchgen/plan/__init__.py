"""The static plan: a per-layer DAG of compute and transfer nodes (dag.py, layer.py), priced by the latency
model (decode.py), and the planner that enumerates batch shapes, KV residency, where attention runs and
whether expert weights are streamed, keeping the fastest plan that fits device and host memory (planner.py)."""

from batchgen.plan.dag import Dag
from batchgen.plan.decode import DecodeGrid, DecodePrice, price_decode
from batchgen.plan.layer import LayerCosts, build_layer_dag, compute_time, layer_time
from batchgen.plan.planner import Plan, WorkloadStats, needs_plan, plan_job

__all__ = ["Dag", "DecodeGrid", "DecodePrice", "LayerCosts", "Plan", "WorkloadStats", "build_layer_dag",
           "compute_time", "layer_time", "needs_plan", "plan_job", "price_decode"]
