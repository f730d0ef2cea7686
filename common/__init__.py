"""Code shared by both stages: configs, the store contract, logging, distributed start-up."""

__version__ = "0.1.0"
