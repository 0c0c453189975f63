"""Measuring a head: the offline decoding loop, n-gram prompt lookup, train-vs-serve diagnosis, k per batch size."""
