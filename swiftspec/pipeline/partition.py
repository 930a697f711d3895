"""How the target's decoder layers are split into pipeline stages: contiguous ranges balanced by
the weight bytes a forward reads (PipeDec §3.2's stage balance, by bytes since decoding is
memory-bound), and those bytes read from a checkpoint's file headers."""
from __future__ import annotations

from pathlib import Path


def partition_layers(layer_bytes: list[int], stages: int, head_bytes: int = 0, first_bytes: int = 0) -> list[range]:
    """Split layers ``0..L-1`` into ``stages`` contiguous non-empty ranges minimizing the largest
    stage's bytes, the last stage also reading ``head_bytes`` (final norm + LM head), the first
    ``first_bytes`` (the draft model that shares its process, in ``pipedec``).

    Raises:
        ValueError: fewer layers than stages, or fewer than one stage.
    """
    n = len(layer_bytes)
    if stages < 1 or n < stages:
        raise ValueError(f"cannot split {n} layers into {stages} pipeline stages")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (head_bytes if b == n else 0) + (first_bytes if a == 0 else 0)

    # best[k][i]: the smallest largest-stage cost of layers [0, i) in k stages; cut[k][i]: where the last begins
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                c = max(best[k - 1][j], cost(j, i))
                if c < best[k][i]:
                    best[k][i], cut[k][i] = c, j
    out, i = [], n
    for k in range(stages, 0, -1):
        out.append(range(cut[k][i], i))
        i = cut[k][i]
    return out[::-1]


def checkpoint_layer_bytes(model_dir: str | Path, num_layers: int) -> tuple[list[int], int]:
    """``(bytes of each decoder layer's weights, bytes of the final norm + LM head)`` as stored
    (GGUF blocks where the loader kept them, else the float tensors); read from the file headers."""
    from safetensors import safe_open

    from swiftspec.weights.loader import NATIVE_FILE

    sizes: dict[str, int] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    native = Path(model_dir) / NATIVE_FILE
    for f in files + ([native] if native.is_file() else []):  # native blocks override float copies
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                sizes[name] = numel * _itemsize(sl.get_dtype())
    layers = [0] * num_layers
    head = 0
    for name, b in sizes.items():
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "layers":
            layers[int(parts[1])] += b
        elif parts[0] == "lm_head":
            head += b
    if head == 0:  # tied: the LM head reads the embedding matrix
        head = sizes.get("model.embed_tokens.weight", 0)
    return layers, head


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
            "BOOL": 1}.get(dtype, 4)
