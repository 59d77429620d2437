"""fedcore: the engine and methods behind the fedprompt-repro pipeline."""

__version__ = "0.1.0"
