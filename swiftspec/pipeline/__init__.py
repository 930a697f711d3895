"""Pipeline-parallel decoding: stages, the pipelined decode loops (PipeDec, PipeInfer) and stage workers."""

# the pipeline modes (EngineConfig.mode): stage 0 of each leads, the later stages follow it
MODES = ("pipedec", "pipeinfer", "pipeline-autoregressive")
