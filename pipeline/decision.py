"""deploy-measure's verdict as a value: whether the new head goes to production and the measurement that
says so (the handover acts on `deploy`, people read `line`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    """deploy-measure's verdict: whether the new head goes to production, and the measurement that says so."""
    deploy: bool
    reason: str

    @property
    def line(self) -> str:
        return f"{'deploy' if self.deploy else 'do not deploy'}: {self.reason}"

    @classmethod
    def from_figures(cls, figures: dict) -> Decision | None:
        """The decision a run recorded (deploy-measure's figures `deploy` and `decision`); a run recorded
        before `deploy` existed says it by its line's first word."""
        line = figures.get("decision")
        if not line:
            return None
        deploy = figures.get("deploy")
        if deploy is None:
            deploy = str(line).startswith("deploy:")
        return cls(bool(deploy), str(line).split(": ", 1)[-1])
