"""Serving on this host: vLLM servers, the host's ports and their locks, processes, modes, client, Mooncake, deploy."""
