"""The shape of the tree docs/layout.md draws: imports point one way, brag.py needs
only its three packages, and no function is longer than a reader can hold in their head."""

from __future__ import annotations

import ast
import sys
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BRAG_PACKAGES = {"numpy", "scipy", "bm25s"}
MAX_FUNCTION_LINES = 60


def project_modules() -> dict[str, Path]:
    """Every module of the product (not the tests or the benchmarks), by its dotted name."""
    found = {p.stem: p for p in ROOT.glob("*.py")}
    for init in ROOT.rglob("__init__.py"):
        package = init.parent.relative_to(ROOT)
        if package.parts[0] in ("tests", "bench", "data", "build") or package.parts[0].startswith("."):
            continue
        dotted = ".".join(package.parts)
        found[dotted] = init
        found |= {f"{dotted}.{p.stem}": p for p in init.parent.glob("*.py") if p.stem != "__init__"}
    return found


def _is_main_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)


def imported_names(path: Path, module: str, modules: Collection[str] = ()) -> set[str]:
    """The dotted names a module imports, anywhere in it but its ``if __name__ == "__main__"``.

    ``from package import name`` imports the module ``package.name`` when it is one of
    ``modules``, and the package itself only for the names that are not modules.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _is_main_block(node):
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            inner = {f"{base}.{alias.name}" for alias in node.names}
            names |= inner
            if not inner <= set(modules):
                names.add(base)
        stack.extend(ast.iter_child_nodes(node))
    return names


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {
        name: {n for n in imported_names(path, name, modules) if n in modules and n != name}
        for name, path in modules.items()
    }


def test_brag_imports_only_the_standard_library_and_its_three_packages():
    outside = {
        name.split(".")[0]
        for name in imported_names(ROOT / "brag.py", "brag")
        if name.split(".")[0] not in sys.stdlib_module_names
    }
    assert outside and outside <= BRAG_PACKAGES, outside


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    assert "bragkit.cli" in graph and "brag" in graph["bragkit.cli"]  # the graph sees real imports
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != "open", " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_modules_that_brag_imports_never_import_it_back():
    graph = import_graph()
    assert not graph["brag"], graph["brag"]


def test_calibrate_is_the_fitting_api_and_imports_nothing_from_bragkit():
    graph = import_graph()
    assert graph["calibrate"] == {"brag"}, graph["calibrate"]
    assert "calibrate" in graph["bragkit.fits"] and "calibrate" in graph["bragkit.calibrate_cli"]


def long_functions() -> list[str]:
    found = []
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{name}.{node.name}: {lines} lines")
    return found


def test_no_function_is_longer_than_sixty_lines():
    assert long_functions() == []


def test_pip_install_gives_the_modules_the_data_and_a_brag_command(tmp_path):
    import json
    import shutil
    import subprocess

    source = tmp_path / "source"  # a copy: a build writes into the folder it builds
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "tests", "bench", "docs", "build", "*.egg-info")
    )
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*install, "--target", str(site), str(source)], check=True, capture_output=True)
    shutil.rmtree(source)  # what runs below comes from the install alone
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    probe = (
        "import json, brag, calibrate, bragkit.serving.inputs; from bragkit import llms; "
        "print(json.dumps([brag.__file__, llms.__file__, brag.PRIOR_CALIBRATION_PATH.is_file(), "
        "sorted(brag.shipped_calibrations()), (brag.Path(llms.__file__).parent / 'worker.py').is_file()]))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    brag_file, llms_file, has_prior, shipped, has_worker = json.loads(found.stdout)
    assert Path(brag_file).parent == site and Path(llms_file).parent == site / "bragkit" / "llms"
    assert has_prior and has_worker
    assert (
        "prior" in shipped and len(shipped) == len(list((ROOT / "data" / "calibrations").glob("*.json"))) + 1
    )

    docs = tmp_path / "docs.json"
    docs.write_text(json.dumps(["alpha rivers", "beta lakes", "gamma hills"]))
    command = [str(site / "bin" / "brag"), "index", str(docs), str(tmp_path / "out")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "brag_corpus.json").is_file()


def drawn_order(guide: str) -> list[str]:
    """The modules the layout drawing (docs/layout.md) names, top to bottom, as dotted names.

    Each line starts with a file's path; a package is its ``__init__.py``.
    """
    import re

    drawing = guide.split("```", 2)[1]  # the first code block is the drawing
    paths = [m.group(1) for line in drawing.splitlines() if (m := re.match(r"^([\w/]+)\.py\s", line))]
    return [path.removesuffix("/__init__").replace("/", ".") for path in paths]


def test_the_layout_guide_draws_every_module_each_below_what_it_imports():
    order = drawn_order((ROOT / "docs" / "layout.md").read_text(encoding="utf-8"))
    assert sorted(order) == sorted(project_modules())
    for module, imports in import_graph().items():
        for imported in imports:
            assert order.index(imported) < order.index(module), f"{module} imports {imported}, drawn below it"


# Every public name of llms.py before it became a package (issue 35): users import them.
LLMS_NAMES = """
CACHE_MODES CacheDamaged CacheMiss CachedLLM CallOptions DEFAULT_HF_MODEL DEFAULT_MAX_RESPONSE_BYTES
EndpointRefused EndpointUnreachable GuardedTransport HFInference LLMError LLMTimeout LOCAL_MODELS
LocalModel LocalModelCrashed LocalRunner LocalWeights MAX_TOKEN_PIECE_CHARS MIN_LOGPROB
MalformedResponse ModelNotFound OpenAICompatible PROMPT_FORMATS QWEN_CODER RateLimited
RequestRejected ResponseTooLarge RetryPolicy SMOLLM2 TokenRejected WeightPart bound_hub_calls
check_token deadline deadline_at default_model is_model_id is_public_address local_idle_timeout
local_runner make_llm max_response_bytes positive_setting redact_url request_key time_left
token_logprobs weights_file
""".split()


def test_import_llms_still_gives_every_name_it_gave_as_one_file():
    from bragkit import llms

    assert [name for name in LLMS_NAMES if not hasattr(llms, name)] == []
    assert set(LLMS_NAMES) <= set(llms.__all__)
    assert all(not name.startswith("_") for name in llms.__all__)


def test_each_section_of_brag_uses_only_the_sections_above_it():
    """Read top to bottom, brag.py never uses a name a later section defines (annotations aside)."""
    import ast

    source = (ROOT / "brag.py").read_text(encoding="utf-8")
    lines = source.split("\n")
    rule = "# " + "-" * 90
    banners = [i + 1 for i, line in enumerate(lines[:-2]) if line == rule == lines[i + 2]]
    assert len(banners) >= 12

    def section(lineno: int) -> int:
        return sum(start < lineno for start in banners)

    tree = ast.parse(source)
    defined: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined[node.name] = section(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                defined[name.id] = section(node.lineno)
    annotations = {
        id(n)
        for node in ast.walk(tree)
        for a in (
            [node.returns, *(x.annotation for x in (*node.args.args, *node.args.kwonlyargs))]
            if isinstance(node, ast.FunctionDef)
            else [node.annotation]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if a is not None
        for n in ast.walk(a)
    }
    later = sorted(
        {
            f"{lines[banners[section(node.lineno) - 1]]} uses {n.id}"
            for node in tree.body
            for n in ast.walk(node)
            if isinstance(n, ast.Name)
            and id(n) not in annotations
            and defined.get(n.id, 0) > section(node.lineno) > 0
        }
    )
    assert later == []


def test_brag_exports_what_users_import_and_extenders_need_and_nothing_only_tests_use():
    """Each name in ``brag.__all__`` is used by the product or the benchmarks, or documented."""
    import re

    import brag

    product = [
        p.read_text(encoding="utf-8")
        for p in ROOT.rglob("*.py")
        if p.parts[len(ROOT.parts)] not in ("tests", ".venv", "build") and p.name != "brag.py"
    ]
    docs = "\n".join(p.read_text(encoding="utf-8") for p in [*ROOT.glob("docs/*.md"), ROOT / "README.md"])
    unused = [
        name
        for name in brag.__all__
        if not any(re.search(rf"\bbrag\.{name}\b|from brag import[^\n]*\b{name}\b", text) for text in product)
        and not re.search(rf"`(brag\.)?{re.escape(name)}[`(.\[]", docs)
    ]
    assert unused == []
    assert all(hasattr(brag, name) for name in brag.__all__) and len(set(brag.__all__)) == len(brag.__all__)
