"""The trainer's own process: its launcher and what the nodes of one job agree on."""
