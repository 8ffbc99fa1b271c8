"""The package's source reads in a 140-column editor: the formatting the code was written to
(black -l 140 -S on what exceeds it), kept so a line over the limit is caught where it is added."""

from pathlib import Path

import dpsm_ray

LIMIT = 140


def test_every_package_line_fits_140_columns():
    package = Path(dpsm_ray.__file__).parent
    long = [f"{path.relative_to(package)}:{number} ({len(line)} characters)"
            for path in sorted(package.rglob("*.py"))
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if len(line) > LIMIT]
    assert long == [], f"{len(long)} lines over {LIMIT} characters: reflow them (black -l {LIMIT} -S --line-ranges=N-N FILE)"


def test_no_package_file_but_a_method_s_card_and_objective_names_a_method():
    """The cards are the only list of methods (docs/extending.md): a method's name as a string
    anywhere else in the package -- a title table, a headline, a preset -- is a list kept by hand,
    which a new method would have to find and edit."""
    import ast

    from dpsm_ray.cards import method_names

    package = Path(dpsm_ray.__file__).parent
    names = set(method_names())
    found = [f"{path.relative_to(package)}:{node.lineno}: {node.value!r}"
             for path in sorted(package.rglob("*.py")) if path.relative_to(package).parts[0] not in ("cards", "objectives")
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]
    assert found == [], "method names outside dpsm_ray/cards and dpsm_ray/objectives:\n" + "\n".join(found)


def test_a_module_s_helpers_are_private():
    """A module-level function or constant that no other file names (the package, the tests, the
    docs, the scripts) and its ``__all__`` does not list is the module's own helper: its name
    starts with ``_``, so that what a module offers is what it does not hide (classes aside)."""
    import ast
    import os
    import re

    package = Path(dpsm_ray.__file__).parent
    root = package.parent
    texts = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and not (Path(folder) == root and d == "results")]
        texts.update({Path(folder) / f: (Path(folder) / f).read_text(encoding="utf-8", errors="replace")
                      for f in files if f.endswith((".py", ".md", ".yaml", ".toml", ".sh"))})
    where: dict[str, set] = {}
    for path, text in texts.items():
        for word in set(re.findall(r"\w+", text)):
            where.setdefault(word, set()).add(path)
    public = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(texts[path])
        listed = {n.value for node in tree.body if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
                  for n in ast.walk(node.value) if isinstance(n, ast.Constant)}
        for node in tree.body:
            names = ([node.name] if isinstance(node, ast.FunctionDef) and not node.decorator_list else
                     [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [])
            public += [f"{path.relative_to(package)}:{node.lineno} {name}" for name in names
                       if not name.startswith("_") and name not in listed and where.get(name, set()) <= {path}]
    assert public == [], "module helpers named nowhere else: start their names with _\n" + "\n".join(public)
