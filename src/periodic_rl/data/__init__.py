"""Prompt sources and the prompt data module."""

from periodic_rl.data.datamodule import PromptDataModule
from periodic_rl.data.sources import PromptSource, load_source

__all__ = ["PromptDataModule", "PromptSource", "load_source"]
