"""batchgen: batch LLM inference on Mixture-of-Experts models with sequence coroutines."""

__version__ = "0.1.0"
