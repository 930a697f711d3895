"""Running one model on one rank: the runner, CUDA graphs, SM partitions, the sampler, models and layers."""
