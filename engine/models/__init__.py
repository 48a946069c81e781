from .config import ModelConfig
from .errors import ModelLoadError
from .loader import LoadedModel, load_model
from .tokenizer import ModelTokenizer

__all__ = ["LoadedModel", "ModelConfig", "ModelLoadError", "ModelTokenizer", "load_model"]
