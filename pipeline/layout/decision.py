"""deploy-measure's verdict as a value: whether the new head goes to production and the measurement that
says so (the handover acts on `deploy`, people read `line`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    deploy: bool
    reason: str

    @property
    def line(self) -> str:
        return f"{'deploy' if self.deploy else 'do not deploy'}: {self.reason}"
