"""Stand-in ``torchvision`` for the SGLang peer venv that ``scripts/peer_venv.sh`` builds.

SGLang's config package imports torchvision's transforms at import time (multimodal model
configs); the tree and storage peers never call them, and the package index has no CPU
torchvision build for torch 2.13 (its wheels need the CUDA torch). Every submodule imports and
every name resolves to a placeholder that raises when called, so any real use fails loudly.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0+peer-stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class Placeholder:
    """Any torchvision name: builds as a type would, refuses to run."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("torchvision is a stand-in in this venv (scripts/peer_venv.sh)")


def _lookup(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return InterpolationMode if name == "InterpolationMode" else Placeholder


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        return _lookup(name)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Submodules())


def __getattr__(name: str) -> object:
    # ``torchvision.transforms`` and the like are submodules; capitalised names are classes.
    if name[:1].islower():
        return importlib.import_module(f"{__name__}.{name}")
    return _lookup(name)
