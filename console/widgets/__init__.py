"""The console's own widgets."""
from console.widgets.grid import Grid
from console.widgets.line import Line
from console.widgets.quiet import QuietStatic
from console.widgets.stages import StageTable
from console.widgets.table import DiffTable

__all__ = ["DiffTable", "Grid", "Line", "QuietStatic", "StageTable"]
