"""Throughput measurements of the strategies on the reference workloads (MLP and CNN)."""
