"""Shared fixtures: tiny Llama / Qwen2 models built by the tests themselves (no hub access)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

# no quantized-GEMM self-tuning at engine start (seconds of timing per new weight shape; the
# choice is the rule's): tests/test_kernel_tuning.py turns it on where it tests it
os.environ["SWIFTSPEC_KERNEL_TUNING"] = "0"

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def pytest_configure(config):
    config.addinivalue_line("markers", "real_models: needs the default model pair (downloads ~1.6 GB from PyPI)")
    config.addinivalue_line("markers", "slow: takes more than a minute")


@pytest.fixture(autouse=True)
def _process_state_restored():
    """Every test leaves the pytest process's intra-op threads and CPU affinity as it found them:
    the kernel benchmarks set the thread count per case, and a test after them would otherwise
    run its in-process models on one thread."""
    threads = torch.get_num_threads()
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if cores is not None and os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)


def build_tokenizer(out_dir: Path):
    """A character-level fast tokenizer: 3 special tokens + printable ASCII (98 tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token="?")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(out_dir: Path, arch: str = "qwen2", seed: int = 0, *, hidden=64, layers=2, heads=4,
                     kv_heads=2, intermediate=128, vocab=128, tie=True, std=0.3, perturb_from: Path | None = None,
                     perturb: float = 0.0, rope_scaling=None) -> Path:
    """Save a random tiny model (plus the tiny tokenizer) as a Hugging Face directory.

    ``std`` is large so next-token distributions are peaked (no near-ties in greedy tests).
    With ``perturb_from``, copy that model's weights plus Gaussian noise of scale ``perturb``:
    a draft that mostly agrees with its target.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=std, eos_token_id=2,
                  bos_token_id=None, rope_theta=10000.0)
    if arch == "qwen2":
        cfg = Qwen2Config(**common)
    else:
        cfg = LlamaConfig(**common, attention_bias=False, rope_scaling=rope_scaling)
    torch.manual_seed(seed)
    if perturb_from is not None:
        model = AutoModelForCausalLM.from_pretrained(perturb_from, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "bias" in name:
                    p.normal_(0, std)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, tiny_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-draft"), "qwen2", seed=1, perturb_from=tiny_dir,
                            perturb=0.05)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=2, tie=False,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def real_models_enabled() -> bool:
    return os.environ.get("SWIFTSPEC_REAL_MODELS") == "1"


def raises_within(it, match: str | None = None, within_s: float = 10.0) -> None:
    """Read the stream ``it`` to its end: it must raise WorkerError (matching ``match``) within
    ``within_s`` seconds (a lost worker or peer is noticed, not waited on)."""
    from swiftspec import WorkerError

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=match):
        for _ in it:
            pass
    assert time.monotonic() - t0 < within_s


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie is dead for our purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
