"""Model runtime: our own Llama / Qwen2 implementation, its KV cache and weight loading."""
from swiftspec.models.config import ModelConfig, ModelConfigError
from swiftspec.models.kv_cache import KVCache
from swiftspec.models.llama import LlamaForCausalLM, load_model

__all__ = ["ModelConfig", "ModelConfigError", "KVCache", "LlamaForCausalLM", "load_model"]
