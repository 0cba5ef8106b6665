"""A run's load (tokens and contexts per rank and iteration) priced on the latency model: the plain chain of
modules (costs.py), two-batch overlap (tbo.py), the per-layer DAG with host copies (costs.price_host) and an
FFN per micro-batch (offload.py, microbatch.py). The simulator prices its runs here; the planners and the
offloading systems' searches price their candidates here."""
