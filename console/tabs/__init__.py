"""The console's tabs, each a component: it composes its own widgets, keeps its own state, renders what the
app hands it and handles its own keys (`KEYS`: bindings whose actions are the tab's own `action_*`; the app
binds them globally and routes each to its tab)."""
from console.tabs.evaluation import EvalTab
from console.tabs.gpus import GpusTab
from console.tabs.notes import NotesTab
from console.tabs.run import RunTab
from console.tabs.server import ServerTab

__all__ = ["EvalTab", "GpusTab", "NotesTab", "RunTab", "ServerTab"]
