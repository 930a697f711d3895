"""TP-aware building blocks (nano-vllm style: each parameter owns its weight loader)."""
