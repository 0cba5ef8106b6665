"""The PyTorch executor: real MoE models driven by the same policies as the simulator."""
