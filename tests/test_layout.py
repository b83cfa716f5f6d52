"""The package layout is the architecture (README's Layout section, shared DESIGN.md section 2):
each package imports only the packages below it, and nothing but the package's face and a few
public names sits loose in infinity/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "infinity"
# Lowest first. A package may import its own modules and those of lower layers, never a higher one.
LAYERS = [{"config", "_native"}, {"io"}, {"optim", "device"}, {"offload"}, {"zero"}, {"checkpoint"}, {"engine"},
          {"deepspeed"}, {"apps", "integrations"}]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# The face (`infinity/__init__.py`, at the engine's layer) and the public names of moved modules.
LOOSE = {"__init__": RANK["engine"], "_native": 0, "checkpointing": RANK["deepspeed"], "utils": RANK["deepspeed"],
         "lightning": RANK["integrations"]}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "infinity":
            if node.module == "infinity":
                found += [(f"infinity.{a.name}", node.lineno) for a in node.names]
            else:
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "infinity"]
    return found


def _rank_of(module: str) -> int:
    package = _package(module)
    if package is None:
        return LOOSE["__init__"]
    return RANK[package] if package in RANK else LOOSE[package]


def test_nothing_loose_but_the_face_and_public_names():
    loose = {p.stem for p in ROOT.glob("*.py")}
    assert loose <= set(LOOSE), sorted(loose - set(LOOSE))
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(RANK), sorted(packages - set(RANK))


def test_no_package_imports_one_above_it():
    upward = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = _package(module)
        if package is None or package in LOOSE:
            continue
        for name, line in _imports(path):
            if _rank_of(name) > RANK[package]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not upward, "\n".join(upward)


def test_every_note_is_where_it_is_cited():
    """A `[Note: x] in path` names the file whose text defines the Note (a line that begins with
    it): after files move or split, a citation that still names the old place fails here."""
    repo = ROOT.parent
    paths = [p for pattern in ("infinity/**/*.py", "csrc/**/*.h", "csrc/**/*.cpp", "tests/*.py", "bench/*.py")
             for p in repo.glob(pattern)]
    texts = {p: p.read_text(errors="replace") for p in paths}
    defined: dict[str, set[str]] = {}
    head = re.compile(r'^\s*(?:#|//|""")?\s*\[Note: ([^\]]+)\](?!\)| in )', re.M)
    for p, text in texts.items():
        for m in head.finditer(text):
            defined.setdefault(m.group(1), set()).add(p.relative_to(repo).as_posix())
    cite = re.compile(r"\[Note: ([^\]]+)\]\)?,?\s+in\s+`?([\w/.]+\.(?:py|h|cpp))")
    wrong = []
    for p, text in texts.items():
        flat = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", text)  # citations wrap across lines and comments
        for m in cite.finditer(flat):
            name, where = m.groups()
            homes = defined.get(name, set())
            if not any(h == where or h.endswith("/" + where) for h in homes):
                wrong.append(f"{p.relative_to(repo)}: [Note: {name}] in {where}, defined in {sorted(homes) or 'none'}")
    assert not wrong, "\n".join(wrong)
