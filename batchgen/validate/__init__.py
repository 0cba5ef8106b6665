"""`python -m batchgen.validate`: the simulator checked against the executor on this machine.

Each case (a workload and a policy) runs on the executor (CPU, repeated, threads pinned) and on the simulator
priced by the CPU calibration, with the same lengths, the same policy, the same backend capabilities and the
same KV pool, so that both take the same decisions; what is left to differ is time. Per case: measured BCT
(median and spread), predicted BCT, the error, per-module errors, and whether the decision traces are equal.
"""
