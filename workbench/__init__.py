"""workbench: exact on-policy RL, with generator and trainer bitwise identical."""

__version__ = "0.1.0"
