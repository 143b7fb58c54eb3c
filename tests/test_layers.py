"""The package's layers, read from its import statements (at any depth, inside functions too): imports run
one way, from the scripts down to the foundation, never in a circle."""
import ast

from helpers import ROOT

PACKAGE = 'denoised_gpt'
# beside the scripts, as in nanoGPT (model.py's fused loss in a file of its own); every other top-level file is one
ALLOWED_SCRIPTS = {'model', 'fused_loss', 'configurator'}
FOUNDATION = ('denoised_gpt.checkpoint_base', 'denoised_gpt.weights')
FORMATS = FOUNDATION + ('denoised_gpt.sharded_checkpoint', 'denoised_gpt.checkpoint', 'denoised_gpt.hf_format')
ABOVE_FORMATS = ('denoised_gpt.models', 'denoised_gpt.cli', 'denoised_gpt.training')


def package_modules():
    """{dotted module name: its path} for every .py file of the package."""
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob('*.py')):
        name = '.'.join(path.relative_to(ROOT).with_suffix('').parts)
        modules[name.removesuffix('.__init__')] = path
    return modules


def imported_names(path):
    """Every absolute name an import statement of the file names: 'a.b' for `import a.b`, 'a' and 'a.x'
    for `from a import x`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names |= {node.module or ''} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_graph():
    modules = package_modules()
    return {m: {t for t in imported_names(p) if t in modules and t not in (m, PACKAGE)} for m, p in modules.items()}


def cycles(graph):
    """The import circles a depth-first walk meets, each as 'a -> b -> a'."""
    state, found = {}, []

    def visit(module, path):
        state[module] = 'open'
        for target in sorted(graph[module]):
            if state.get(target) == 'open':
                found.append(' -> '.join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 'done'

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_package_imports_run_one_way():
    graph = import_graph()
    assert {'denoised_gpt.checkpoint', 'denoised_gpt.models', 'denoised_gpt.evaluation.glue'} <= set(graph)
    assert cycles(graph) == []


def test_no_package_module_imports_a_script():
    scripts = {path.stem for path in ROOT.glob('*.py')} - ALLOWED_SCRIPTS
    assert 'train' in scripts
    offending = {m: sorted(n for n in imported_names(p) if n.split('.')[0] in scripts)
                 for m, p in package_modules().items()}
    assert {m: names for m, names in offending.items() if names} == {}


def test_the_formats_know_nothing_of_what_builds_models_or_the_command_line():
    graph = import_graph()
    assert all(not graph[m] for m in FOUNDATION), {m: graph[m] for m in FOUNDATION}
    reaching = {m: sorted(reachable(graph, m) & set(ABOVE_FORMATS)) for m in FORMATS}
    assert {m: above for m, above in reaching.items() if above} == {}


def test_the_model_files_need_torch_and_the_standard_library_only():
    """model.py and fused_loss.py travel alone (an exported Hugging Face folder copies them): they import torch,
    the standard library and each other at the top; inside functions, model.py may import what is optional there
    (the package's Triton kernel, with a fallback; transformers for GPT-2 weights)."""
    import sys
    optional = {'model': {'denoised_gpt', 'transformers'}, 'fused_loss': set()}
    for name, inside_functions in optional.items():
        tree = ast.parse((ROOT / f'{name}.py').read_text())
        top, anywhere = set(), set()
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) else [])
            anywhere |= {m.split('.')[0] for m in modules}
        for node in tree.body:  # module level, try blocks included
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.ClassDef)):
                    break
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    top |= {m.split('.')[0] for m in ([a.name for a in inner.names] if isinstance(inner, ast.Import)
                                                        else [inner.module])}
        own = {'torch', 'fused_loss', 'model'} | set(sys.stdlib_module_names)
        assert top <= own, (name, top - own)
        assert anywhere <= own | inside_functions, (name, anywhere - own - inside_functions)
