"""The architecture registry: `general.architecture` -> the Family that builds it.

Every command, trainer and bench loads a model through `load_model` (or reads
`family_of`), so none of them names an architecture. Adding one is a Family
in pipeline/models/<arch>.py plus a line here (docs/models.md, "Adding an
architecture").
"""
from __future__ import annotations

from ..errors import UserError
from .gemma3 import GEMMA3
from .llama import LLAMA
from .qwen2 import QWEN2
from .qwen3 import QWEN3

ARCHITECTURES = {f.name: f for f in (GEMMA3, LLAMA, QWEN2, QWEN3)}


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def family(name: str, where: str = ""):
    """The registered Family called `name`; an unknown name is one UserError listing the supported ones."""
    fam = ARCHITECTURES.get(name)
    if fam is None:
        prefix = f"{where}: " if where else ""
        raise UserError(f"{prefix}architecture '{name}' is not supported (supported: {supported()})")
    return fam


def family_of(gg):
    """The Family of an open GGUFFile, from its general.architecture."""
    return family(gg.architecture, str(gg.path))


def load_model(path_or_gguf, trainable: bool = False, llama_numerics: bool = False):
    """The model of a GGUF of any registered architecture (a pipeline.models.decoder.DecoderLM)."""
    from .decoder import DecoderLM
    return DecoderLM.from_gguf(path_or_gguf, trainable=trainable, llama_numerics=llama_numerics)
