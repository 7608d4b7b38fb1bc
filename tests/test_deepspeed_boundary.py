"""Only ``lnstrain/deepspeed_adapter.py`` uses DeepSpeed beyond its public API (issue 17).

Read from the source: every ``import``/``from ... import`` of DeepSpeed in lnstrain, at module level,
inside a function or under ``TYPE_CHECKING``, and every attribute read through a name such an import
binds (``deepspeed.runtime...`` after ``import deepspeed``), must be in ``PUBLIC`` below, except in
the adapter, which is where a DeepSpeed upgrade is checked first.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lnstrain"
ADAPTER = PACKAGE / "deepspeed_adapter.py"

# DeepSpeed's public API as lnstrain uses it. The three modules may be imported (to reach the names
# after them); every other entry is a name, imported or read as an attribute. deepspeed.comm counts
# as public as a whole: its functions mirror torch.distributed's, except those named with an underscore.
PUBLIC_MODULES = {"deepspeed", "deepspeed.comm", "deepspeed.pipe"}
PUBLIC_NAMES = {
    "deepspeed.initialize",
    "deepspeed.init_distributed",
    "deepspeed.DeepSpeedEngine",  # the type deepspeed.initialize returns, for annotations
    "deepspeed.__version__",
    "deepspeed.pipe.PipelineModule",
    "deepspeed.pipe.LayerSpec",
    "deepspeed.pipe.TiedLayerSpec",
}


def is_public(name: str) -> bool:
    if name in PUBLIC_MODULES or name in PUBLIC_NAMES:
        return True
    module, _, last = name.rpartition(".")
    return module == "deepspeed.comm" and not last.startswith("_")


def is_deepspeed(name: str) -> bool:
    return name == "deepspeed" or name.startswith("deepspeed.")


def dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def internal_uses(source: str) -> list[str]:
    """Every DeepSpeed name ``source`` imports, or reads through an imported module, outside the public API."""
    tree = ast.parse(source)
    found = []
    bound: dict[str, str] = {}  # local name -> the DeepSpeed module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_deepspeed(alias.name):
                    found.append(alias.name)
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:  # ``import deepspeed.x`` binds ``deepspeed``
                        bound["deepspeed"] = "deepspeed"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_deepspeed(node.module or ""):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.append(name)
                if name in PUBLIC_MODULES:
                    bound[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        parts = dotted(node)
        if parts is None or parts[0] not in bound:
            continue
        name = bound[parts[0]]
        for part in parts[1:]:  # the chain up to its first name outside the public modules
            name = f"{name}.{part}"
            if name not in PUBLIC_MODULES:
                break
        found.append(name)
    return sorted({name for name in found if not is_public(name)})


def test_the_checker_finds_every_kind_of_internal_use():
    source = """
import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import PipelineModule, LayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed import comm, utils

def f():
    from deepspeed.utils import logger
    deepspeed.initialize()
    deepspeed.runtime.config.DeepSpeedConfig({})
    dist.all_reduce(x)
    dist._private()
    comm.barrier()
"""
    assert internal_uses(source) == ["deepspeed.comm._private", "deepspeed.runtime",
                                     "deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology",
                                     "deepspeed.utils", "deepspeed.utils.logger"]
    assert internal_uses("import deepspeed\nfrom deepspeed.pipe import TiedLayerSpec\ndeepspeed.init_distributed()\n"
                         "v = deepspeed.__version__\n") == []


def test_only_the_adapter_uses_deepspeed_internals():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == ADAPTER:
            continue
        internal = internal_uses(path.read_text(encoding="utf-8"))
        if internal:
            offenders[str(path.relative_to(PACKAGE.parent))] = internal
    assert not offenders, ("DeepSpeed internals outside lnstrain/deepspeed_adapter.py (route them through it):\n"
                           + "\n".join(f"{path}: {', '.join(names)}" for path, names in offenders.items()))


def test_the_adapter_is_where_the_internals_are():
    assert "deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology" in internal_uses(
        ADAPTER.read_text(encoding="utf-8"))
