"""What an installed gradshare ships for its users' tools: type information and one version."""
import ast
import os
import re

import gradshare
import gradshare._C as native

HERE = os.path.dirname(gradshare.__file__)


def _stub_arguments():
    with open(os.path.join(HERE, "_C.pyi")) as f:
        tree = ast.parse(f.read())
    return {f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)}


def test_native_stub_names_every_binding_and_its_arguments():
    stubs = _stub_arguments()
    bound = {n for n in dir(native) if not n.startswith("_") and callable(getattr(native, n)) and n != "MessageError"}
    assert set(stubs) == bound
    for name, args in stubs.items():
        first = getattr(native, name).__doc__.splitlines()[0]          # pybind11: "name(a: int, ...) -> ..."
        inside = first[first.index("(") + 1:first.rindex(")")]
        assert re.findall(r"(\w+):", inside) == args, f"{name}: binding says {first!r}"


def test_typed_package_with_one_version():
    assert os.path.exists(os.path.join(HERE, "py.typed"))
    assert gradshare.build_info()["version"] == gradshare.__version__   # the native library's, from the same place


def test_a_user_script_passes_mypy_strict(tmp_path):
    """The public API is typed for a user's checker: no missing stubs, no untyped calls (tests/typed_user_script.py)."""
    import pytest

    api = pytest.importorskip("mypy.api")
    script = os.path.join(os.path.dirname(__file__), "typed_user_script.py")
    out, err, code = api.run(["--strict", "--cache-dir", str(tmp_path), script])
    assert code == 0, out + err
