"""Pipeline-parallel decoding: stages, the pipelined decode loops (PipeDec, PipeInfer) and stage workers."""
