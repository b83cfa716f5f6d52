"""`deepspeed` as infinity, in the processes that ask for it: `infinity run` starts its ranks so,
`python -m infinity.deepspeed train.py ...` runs one script so (under torchrun too:
`torchrun --nproc-per-node 2 -m infinity.deepspeed train.py ...`), and `infinity.as_deepspeed()`
turns it on in a running interpreter (a notebook), before anything imports `deepspeed`,
transformers or accelerate.

[Note: the deepspeed alias]
A finder at the front of `sys.meta_path` answers for `deepspeed` and every `deepspeed.X`: their
module is `infinity.deepspeed.X`, a package of thin adapters laid out as DeepSpeed's modules are
(`deepspeed.runtime.zero.partition_parameters` is `infinity.deepspeed.runtime.zero.partition_
parameters`, the very same module object), and a name that package does not have fails to import
as any missing module does. The same finder answers the metadata lookups transformers and
accelerate make before they use DeepSpeed (`importlib.util.find_spec("deepspeed")`,
`importlib.metadata.version / metadata / distribution("deepspeed")`) through
`find_distributions`, the hook `importlib.metadata` documents for finders: a distribution named
deepspeed whose version is the DeepSpeed we follow (DEEPSPEED_VERSION) and which lists no files.
Nothing is installed: a process that did not ask has no `deepspeed` (or the real one, if it is
installed), and `import infinity` alone turns nothing on.

Where the real DeepSpeed is installed too, the alias wins in the processes that ask for it: the
finder comes before the path finder, so `import deepspeed` and its metadata are infinity's there
(a submodule infinity lacks does not fall through to the real package either). Turning the alias
on after the real package was imported is an error: the modules already loaded would stay
DeepSpeed's.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
from collections.abc import Iterator

__all__ = ["DEEPSPEED_VERSION", "ENV", "as_deepspeed", "from_environment", "is_active"]

DEEPSPEED_VERSION = "0.19.8"  # the release whose behaviour and config defaults infinity follows (README)

_ALIAS = "deepspeed"
_TARGET = "infinity.deepspeed"
ENV = "INFINITY_AS_DEEPSPEED"  # [Note: the alias from the environment]
_NOTED = "INFINITY_AS_DEEPSPEED_NOTED"  # set once the shadowed DeepSpeed was reported, for child processes


def _target(fullname: str) -> str | None:
    """The module of ours that `fullname` means, or None when it is not `deepspeed[.X]`."""
    if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
        return _TARGET + fullname[len(_ALIAS):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads `deepspeed.X` as the module `infinity.deepspeed.X` itself (one object, two names)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # The import system returns whatever sys.modules holds under the name once exec_module
        # is done, so the placeholder is dropped and our module keeps its own name and spec.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _AliasDistribution(importlib.metadata.Distribution):
    """DeepSpeed's distribution metadata, as far as version checks read it; no files."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: {_ALIAS}\nVersion: {DEEPSPEED_VERSION}\n"
                    "Summary: infinity standing in for DeepSpeed (infinity.deepspeed._alias)\n")
        if filename == "top_level.txt":
            return _ALIAS + "\n"
        return None

    def locate_file(self, path) -> pathlib.Path:
        return pathlib.Path(__file__).parent / "deepspeed" / path


class _AliasFinder(importlib.metadata.DistributionFinder):
    """[Note: the deepspeed alias]"""

    def find_spec(self, fullname: str, path=None, target=None):
        ours = _target(fullname)
        if ours is None:
            return None
        if fullname != _ALIAS and importlib.util.find_spec(ours) is None:
            return None  # `deepspeed` is imported (it is the parent), so this lookup is cheap
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(ours), is_package=True)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()
                           ) -> Iterator[importlib.metadata.Distribution]:
        name = context.name
        if name is None or re.sub(r"[-_.]+", "-", name).lower() == _ALIAS:
            yield _AliasDistribution()


def is_active() -> bool:
    """Whether `deepspeed` means infinity in this process."""
    return any(isinstance(f, _AliasFinder) for f in sys.meta_path)


def as_deepspeed() -> None:
    """From now on in this process, `import deepspeed` (and `deepspeed.X`) is infinity, and
    `importlib.metadata` reports deepspeed DEEPSPEED_VERSION ([Note: the deepspeed alias]).
    Call it before transformers or accelerate are imported: they look DeepSpeed up once. Calling
    it again does nothing."""
    if is_active():
        return
    loaded = sys.modules.get(_ALIAS)
    if loaded is not None:
        raise RuntimeError(f"as_deepspeed(): the module deepspeed is imported already (from "
                           f"{getattr(loaded, '__file__', None) or loaded!r}); turn the alias on before anything "
                           "imports deepspeed")
    sys.meta_path.insert(0, _AliasFinder())


def from_environment() -> None:
    """[Note: the alias from the environment]
    `INFINITY_AS_DEEPSPEED=1` turns the alias on in every Python process that starts with it set:
    a `.pth` file that `pip install` puts in site-packages (infinity-deepspeed-alias.pth, one line,
    which imports nothing unless the variable is set) calls this at interpreter start-up, before
    the process imports anything of its own. So `accelerate launch --use_deepspeed`, torchrun, a
    plain `python train.py --deepspeed ds.json` and the processes they start (DataLoader workers,
    accelerate's ranks) all see `deepspeed` as infinity. `infinity run` and `python -m
    infinity.deepspeed` set it for what they start. 0 (or unset) leaves everything as it is; any
    other value than 1/0 is reported and leaves it off. Where a real DeepSpeed is installed too, it
    is not shadowed silently: one line on stderr says which `deepspeed` this process tree uses."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return
    if value not in ("1", "true", "yes", "on"):
        print(f"infinity: {ENV}={os.environ[ENV]!r}: expected 1 (deepspeed is infinity) or 0; left off",
              file=sys.stderr)
        return
    real = importlib.machinery.PathFinder.find_spec(_ALIAS)
    if real is not None and not os.environ.get(_NOTED):
        where = real.origin or (list(real.submodule_search_locations or []) or ["?"])[0]
        print(f"infinity: {ENV}=1: `import deepspeed` is infinity in this process and those it starts; the "
              f"DeepSpeed installed at {where} is not used (unset {ENV} to use it)", file=sys.stderr)
        os.environ[_NOTED] = "1"
    as_deepspeed()
