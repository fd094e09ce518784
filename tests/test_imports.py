"""The package's import graph has no cycle: every module of moejax/ and pallas_kernels/ can be read
top to bottom by a newcomer, and importing any one of them never depends on import order."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("moejax", "pallas_kernels")


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
  """The project modules that `path` imports, at any depth of its body (an import inside a function
  is still a dependency). `from package import name` depends on the submodule package.name where
  that is a module, else on the package."""
  name = _module_name(path)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  targets = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
      targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
  found = set()
  for target in targets:
    while target and target not in modules:
      target = target.rpartition(".")[0]
    if target and target != name:
      found.add(target)
  return found


def import_graph() -> dict[str, set[str]]:
  paths = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
  modules = {_module_name(p) for p in paths}
  return {_module_name(p): _imports(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of the graph as [a, b, ..., a], or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_no_import_cycle():
  cycle = find_cycle(import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None
