"""Command-line entry points: train, evaluate, compare, benchmarks."""
