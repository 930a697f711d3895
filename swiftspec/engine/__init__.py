"""The engine: configuration, device placement, worker processes, metrics, detokenization, the machine profile."""
