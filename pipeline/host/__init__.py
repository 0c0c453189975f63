"""The host: its GPUs (the one NVML chokepoint), process groups, and the host-wide lock of each serving port."""
