"""Latency model: seconds per module of one transformer layer, used by the simulator and by planners.

Interface: `LatencyModel` (base.py) is what the simulator, the memory budget and the planner call. Two
implementations: `Roofline` and `TablePredictor` (table.py: measured points of a calibration file, interpolated;
the roofline prices what was not measured). `build_latency` picks one from the `latency` config.

Form of the roofline. Every weight GEMM of a module (fused QKV and O of attention, gate+up and down of an FFN,
the router, the LM head) is priced by `batchgen.latency.gemm`: max(compute, memory) plus a launch, where
compute follows the GEMM's output tiles and the waves they run in when the GPU's SM count is known (the
staircase measured GEMMs show in tokens), else a pad-rows average. Attention scores and KV reads are a roofline
of their own (max(score FLOPs, KV bytes) + one launch per micro-batch), over the sum of the contexts, or over
queries x the longest context for the share `attention_padding` of it that padded kernels pay. Each module runs
at its own fitted factors (`Efficiency.modules`); the engine's own time per forward and per boundary is
`step_overhead` and `boundary_overhead`. Copies and collectives are fixed latency + bytes / (link * bandwidth).
Every method broadcasts numpy arrays and returns seconds (a float for scalar inputs), because the simulator
evaluates a (ranks x iterations) grid at once.

Fitted by calibration (`python -m batchgen.calibrate`): only the fields of `Efficiency`. Data-sheet numbers
come from `HardwareSpec`, architecture from `ModelSpec`; both stay untouched.

Simplifications (decisions where the paper is silent):
- Routed experts use expectations, not samples: expert e receives p_e of the total_tokens * top_k
  token-expert pairs (uniform, or Zipf-like p_e ~ (e+1)^-routing_skew, fixed hot experts); it costs weight
  reads when it receives at least one token, with expected count sum_e 1 - (1 - p_e)^(total_tokens*top_k).
  Experts are placed round-robin (rank r holds e with e % ep_ranks == r). The slowest rank's expected time
  sets the pace of lockstep expert parallelism; sampling noise in per-rank load is not modelled.
- The whole expert batch of a rank is one grouped GEMM per weight (as many tiles as its touched experts
  together, one launch); each attention micro-batch re-reads the attention weights.
- All-to-all: dispatch and combine are two phases, each with collective_s + collective_per_peer_s*(R-1) of
  latency plus the slower of its NVLink share (peers on the same node) and network share (the rest), which
  move in parallel; bandwidths are per GPU, one direction. Overlap of communication with compute is the
  caller's (simulator's, planner's) business: every cost here is for the module alone.
- No contention between concurrent modules on one GPU; norms, residual adds and rotary embeddings are
  folded into the launches (kernel_s).

Host side (`HostSpec`: CPU sockets, cores, DRAM bandwidth, FLOP/s of each node). Every PCIe copy reads or
writes host DRAM, which the node's GPUs share: a GPU's host link runs at min(PCIe x link, DRAM x host_memory /
GPUs per node). Host-resident decode restores each micro-batch's KV of a layer over that link (`kv_restore`)
and appends the new token's KV back (`kv_append`); CPU attention (`cpu_attention`, GQA/MHA only: MLA's latent
KV needs GPU up-projection) is a roofline over the GPU's share of the node's DRAM bandwidth and CPU FLOP/s,
with the queries, new KV and outputs shipped over PCIe (`cpu_attention_ship`). How these overlap with compute
is not decided here: batchgen.plan builds the per-layer DAG and takes its critical path. DRAM contention
between CPU attention and concurrent PCIe copies of the same node is not modelled.
"""
from batchgen.latency.base import LatencyModel
from batchgen.latency.build import LatencySettings, build_latency, check_calibration
from batchgen.latency.efficiency import Efficiency, load_efficiency
from batchgen.latency.roofline import Roofline

__all__ = ["Efficiency", "LatencyModel", "LatencySettings", "Roofline", "build_latency", "check_calibration",
           "load_efficiency"]
