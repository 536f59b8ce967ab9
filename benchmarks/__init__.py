"""Side-by-side benchmarks of specvit and its peers: python -m benchmarks."""
