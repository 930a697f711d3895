"""SM partition of one GPU: a CUDA stream confined to a share of the device's SMs (the colocated
mode's ``draft_sms``; docs/architecture.md §9).

Source: CUDA green contexts (cuDevSmResourceSplitByCount + cuGreenCtxCreate: a context on a share
of the SMs, then a stream in it), the recipe of FlashInfer's ``green_ctx.py`` and SGLang's
PD-multiplexing, through ``torch.cuda.green_contexts``.
"""
from __future__ import annotations

import ctypes

import torch

# Green contexts made by green_context_stream, kept for the life of the process: streams and CUDA
# graphs made in one may outlive the runner that asked for it.
_GREEN_CONTEXTS: list = []


def green_context_stream(sm_count: int, device: torch.device | str) -> torch.cuda.Stream:
    """A CUDA stream of ``device`` whose kernels run on ``sm_count`` of its SMs only.

    The green context (see the module docstring for the source) comes from
    ``torch.cuda.green_contexts.GreenContext.create(num_sms=, device_id=)``. The stream comes
    from the context's ``Stream()`` where torch has it (cuGreenCtxStreamCreate inside torch);
    otherwise (torch builds whose GreenContext has only ``set_context`` / ``pop_context``) the
    context is pushed, a stream is made in it with the driver's cuStreamCreateWithPriority
    (priority 0, non-blocking) and the context popped. Either way the driver then confirms
    (cuStreamGetGreenCtx) that the stream belongs to a green context: no silent fallback to the
    whole device. The context lives as long as the process.

    Args:
        sm_count: SMs, 1 to the device's count; the driver rounds it up to its granularity
            (a multiple of 8 on Hopper).
        device: a CUDA device ("cuda" = the current one).

    Returns:
        a ``torch.cuda.ExternalStream`` (priority 0) for ``torch.cuda.stream(...)``.

    Raises:
        ValueError: ``sm_count`` not a positive int or more than the device has; not a CUDA device.
        RuntimeError: torch without green contexts (``torch.cuda.green_contexts.SUPPORTED`` is
            false: a CPU build, or one for CUDA before 12.8), creation refused (a driver before
            12.8, a GPU or mode without SM partitioning), or no stream bound to the context.
    """
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
        raise ValueError(f"sm_count must be a positive integer, got {sm_count!r}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"an SM partition needs a CUDA device, got {device}")
    green = getattr(torch.cuda, "green_contexts", None)
    if green is None or not getattr(green, "SUPPORTED", False):
        raise RuntimeError(f"an SM partition needs CUDA green contexts, which torch {torch.__version__} lacks "
                           "(torch.cuda.green_contexts.SUPPORTED is false: a CPU build, or one for CUDA < 12.8)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if sm_count > total:
        raise ValueError(f"sm_count={sm_count}, but cuda:{index} has {total} SMs")
    try:
        ctx = green.GreenContext.create(num_sms=sm_count, device_id=index)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or TypeError (an API change)
        raise RuntimeError(f"could not create a CUDA green context of {sm_count} SMs on cuda:{index} "
                           f"(torch {torch.__version__}; needs a CUDA 12.8+ driver): {e}") from e
    _GREEN_CONTEXTS.append(ctx)
    drv = _cuda_driver()
    if hasattr(ctx, "Stream"):
        stream = ctx.Stream()
        handle = stream.cuda_stream
    elif hasattr(ctx, "set_context") and hasattr(ctx, "pop_context"):
        raw = ctypes.c_void_p()
        ctx.set_context()
        try:
            rc = drv.cuStreamCreateWithPriority(ctypes.byref(raw), 1, 0)  # CU_STREAM_NON_BLOCKING
        finally:
            ctx.pop_context()
        if rc != 0:
            raise RuntimeError(f"cuStreamCreateWithPriority in the green context failed: CUresult {rc}")
        handle = raw.value
        stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))
    else:
        raise RuntimeError(f"torch {torch.__version__}'s GreenContext has neither Stream() nor "
                           "set_context()/pop_context(): no way to make a stream in it")
    owner = ctypes.c_void_p()
    rc = drv.cuStreamGetGreenCtx(ctypes.c_void_p(handle), ctypes.byref(owner))
    if rc != 0 or not owner.value:
        raise RuntimeError(f"the stream made for the green context of {sm_count} SMs does not belong to one "
                           f"(cuStreamGetGreenCtx: CUresult {rc}): its kernels would use the whole GPU")
    return stream


def _cuda_driver():
    """The CUDA driver library (ctypes), for the two calls torch does not expose."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"an SM partition needs the CUDA driver library libcuda.so.1: {e}") from None
