"""Model runtime: our own Llama / Qwen2 implementation, its KV cache and weight loading."""
from swiftspec.model_executor.models.config import ModelConfig, ModelConfigError
from swiftspec.model_executor.models.kv_cache import KVCache
from swiftspec.model_executor.models.llama import LlamaForCausalLM, load_model

__all__ = ["ModelConfig", "ModelConfigError", "KVCache", "LlamaForCausalLM", "load_model"]
