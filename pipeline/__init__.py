"""eagle3-console's headless engine: profiles, stages, run state, notes. Never imports Textual."""
__version__ = "0.1.0"
