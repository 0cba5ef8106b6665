"""MoE decoders for the executor (Mixtral, Qwen3-MoE, dense Llama-style), loaded from Hugging Face directories."""

from batchgen.exec.models.config import ExecModelConfig, UnsupportedModelError
from batchgen.exec.models.decoder import MoEDecoder
from batchgen.exec.models.loading import ModelLoadError, init_random, load_model, load_tokenizer, read_config
from batchgen.exec.models.moe import SparseMoE, tokens_per_expert

__all__ = ["ExecModelConfig", "MoEDecoder", "ModelLoadError", "SparseMoE", "UnsupportedModelError", "init_random",
           "load_model", "load_tokenizer", "read_config", "tokens_per_expert"]
