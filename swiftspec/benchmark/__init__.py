"""Benchmarks shared by ``bench/`` scripts and the ``swiftspec bench`` / ``swiftspec profile`` commands."""
