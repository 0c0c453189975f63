"""Before a run: the plan (plan.py) from earlier runs' figures (history.py), each stage's rate (rates.py), the
other stages' costs (steps.py) and online training's splits (online.py); a slice's calibration; preflight's
findings and the vLLM it asks (vllm_probe.py)."""
