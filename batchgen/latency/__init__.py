"""Latency model: seconds per module of one transformer layer, used by the simulator and by planners.

Form (roofline with efficiency factors). Every module is a roofline

    t = max(compute_flops / (compute * peak_flops), bytes / (memory * hbm_bw)) + launches * kernel_s

and 0 when it has no tokens. Weight GEMMs over M rows (tokens) count 2 * params * (M + gemm_pad_rows) FLOPs
(per launch: tile padding and wave quantisation), so a GEMM reaches M / (M + gemm_pad_rows) of the compute
efficiency; attention scores run at the bf16 peak, weight GEMMs at the FP8 peak when `use_fp8` is set, the
GPU has FP8 and weights are 1 byte. Bytes are the weights read (once per launch), the KV read or written
and the hidden states in and out. Copies and collectives are fixed latency + bytes / (link * bandwidth).
Every method broadcasts numpy arrays and returns seconds (a float for scalar inputs), because the simulator
evaluates a (ranks x iterations) grid at once.

Fitted by calibration: only the fields of `Efficiency` (compute, memory, link, kernel_s, collective_s,
collective_per_peer_s, gemm_pad_rows). Data-sheet numbers come from `HardwareSpec`, architecture from
`ModelSpec`; both stay untouched.

Simplifications (decisions where the paper is silent):
- Routed experts use expectations, not samples: expert e receives p_e of the total_tokens * top_k
  token-expert pairs (uniform, or Zipf-like p_e ~ (e+1)^-routing_skew, fixed hot experts); it costs weight
  reads when it receives at least one token, with expected count sum_e 1 - (1 - p_e)^(total_tokens*top_k).
  Experts are placed round-robin (rank r holds e with e % ep_ranks == r). The slowest rank's expected time
  sets the pace of lockstep expert parallelism; sampling noise in per-rank load is not modelled.
- The whole expert batch of a rank is one launch (grouped GEMM); intermediate activations of the FFNs stay
  out of the byte count; each attention micro-batch re-reads the attention weights.
- All-to-all: dispatch and combine are two phases, each with collective_s + collective_per_peer_s*(R-1) of
  latency plus the slower of its NVLink share (peers on the same node) and network share (the rest), which
  move in parallel; bandwidths are per GPU, one direction. Overlap of communication with compute is the
  caller's (simulator's, planner's) business: every cost here is for the module alone.
- No contention between concurrent modules on one GPU; norms, residual adds and rotary embeddings are
  folded into kernel_s.

Host side (`HostSpec`: CPU sockets, cores, DRAM bandwidth, FLOP/s of each node). Every PCIe copy reads or
writes host DRAM, which the node's GPUs share: a GPU's host link runs at min(PCIe x link, DRAM x host_memory /
GPUs per node). Host-resident decode restores each micro-batch's KV of a layer over that link (`kv_restore`)
and appends the new token's KV back (`kv_append`); CPU attention (`cpu_attention`, GQA/MHA only: MLA's latent
KV needs GPU up-projection) is a roofline over the GPU's share of the node's DRAM bandwidth and CPU FLOP/s,
with the queries, new KV and outputs shipped over PCIe (`cpu_attention_ship`). How these overlap with compute
is not decided here: batchgen.plan builds the per-layer DAG and takes its critical path. DRAM contention
between CPU attention and concurrent PCIe copies of the same node is not modelled.
"""
from batchgen.latency.efficiency import Efficiency
from batchgen.latency.roofline import LatencyModel

__all__ = ["Efficiency", "LatencyModel"]
