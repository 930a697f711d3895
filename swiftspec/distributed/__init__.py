"""Tensor-parallel groups and their collectives (gloo / NCCL / the LL communicator)."""
