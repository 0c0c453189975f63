"""Above the stages: the runner, a run as a detached job, its files watched, copied and exported, the other nodes."""
