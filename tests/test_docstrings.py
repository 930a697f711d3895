"""Every public name of the package has a docstring.

Public: a module-level function or class, or a method (``@property`` included) of a public
class, whose name and whose enclosing classes' names do not start with ``_`` (so dunder methods
such as ``__init__`` are not asked for: the class docstring covers construction), in any module
under ``swiftspec/`` except the data files in ``swiftspec/data/``. Functions nested in functions
are not public. Read with :mod:`ast`, so nothing is imported.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "swiftspec"



def undocumented(tree: ast.Module, module: str) -> list[str]:
    """``module:line qualified.name`` of every public function, class and method in ``tree``
    without a (non-blank) docstring."""
    out = []

    def visit(body, prefix):
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not (doc and doc.strip()):
                out.append(f"{module}:{node.lineno} {prefix}{node.name}")
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return out


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("data/"):
            continue
        yield rel, path


def test_every_public_name_has_a_docstring():
    missing = [name for rel, path in _modules()
               for name in undocumented(ast.parse(path.read_text(encoding="utf-8")), f"swiftspec/{rel}")]
    assert not missing, f"{len(missing)} public names without a docstring:\n" + "\n".join(missing)


def test_the_checker_finds_what_it_should():
    """Public functions, classes, methods and properties count; private names, dunders, methods of
    private classes and nested functions do not."""
    src = '''
def f(): pass
def g():
    """ok"""
    def inner(): pass
def _h(): pass
class C:
    def __init__(self): pass
    def m(self): pass
    @property
    def p(self): return 1
    def _q(self): pass
    class D:
        def n(self): pass
class _P:
    def m(self): pass
async def a(): pass
'''
    names = [x.split(" ", 1)[1] for x in undocumented(ast.parse(src), "m")]
    assert names == ["f", "C", "C.m", "C.p", "C.D", "C.D.n", "a"]
    assert len(list(_modules())) > 50 and not any(rel.startswith("data/") for rel, _ in _modules())
