"""Load a converted (format 1) DeepSeek-V4 checkpoint and run it: ``load_model(path)(input_ids)``."""

from .backend import ReferenceBackend
from .checkpoint import Checkpoint
from .config import ModelConfig
from .distributed import World
from .format import FormatError
from .hopper import HopperBackend
from .model import Model, load_model
from .state import DecodeState

__all__ = ["load_model", "Model", "DecodeState", "ModelConfig", "Checkpoint", "ReferenceBackend", "HopperBackend", "FormatError", "World"]
