"""
nanoGPT's "poor man's configurator", with every key checked.

    python train.py config/train_shakespeare_char.py --batch_size=32 --compile=False

Arguments are applied left to right: a plain argument is a config file (flat Python, executed in an
empty namespace; only its assignments matter), `--key=value` overrides one key. Unlike nanoGPT's
exec-into-globals version, a typo cannot silently create a new variable: every key must already
be one of the script's defaults, and every value must have the default's type (an int is accepted
where a float is expected, True or False where the default is 'auto'; a default of None accepts
anything). Errors raise ConfigError naming the file or argument and, for unknown keys, the closest
valid key.

Used by train.py (and sample.py / bench.py) as:

    config = apply_config(sys.argv[1:], defaults, script=__file__)   # defaults: {key: default value}

With `script`, `-h` / `--help` anywhere in argv prints the script's help and exits 0: its docstring,
the usage, and every key with its default and the comment written next to it in the script, so the
help cannot drift from the code. Pass a set as `given` to learn which keys a config file or an
override set (even to the default's value).

A script takes every attention variant's own settings (GPTConfig's fields that a variant's config_fields
names) with the statement `globals().update(variant_settings())` among its settings: their defaults and
meanings are GPTConfig's, so a variant's setting is written once, in model.py.
"""

import ast
import difflib
import io
import os
import stat
import sys
import tokenize
import types


class ConfigError(ValueError):
    """A config file or --key=value override that cannot be applied. Scripts print it and exit 2."""


def apply_config(argv, defaults, script=None, given=None):
    """Return a new dict: `defaults` updated by the config files and --key=value overrides in argv.
    script: the calling script's path, for --help. given: a set that receives every key set."""
    if script is not None and ('-h' in argv or '--help' in argv):
        print(help_text(script, defaults))
        sys.exit(0)
    config = dict(defaults)
    given = set() if given is None else given
    for arg in argv:
        if arg.startswith('--'):
            key, sep, text = arg[2:].partition('=')  # split on the first '=' only: --start=a=b
            if not sep:
                raise ConfigError(f"argument {arg!r}: overrides are written --key=value "
                                  f"(e.g. --{key or 'batch_size'}=...)")
            where = f"command line argument {arg!r}"
            _check_key(key, defaults, where)
            config[key] = _coerce(key, _parse_cli_value(text, defaults[key]), defaults[key], where)
            given.add(key)
        else:
            for key, value in _read_config_file(arg).items():
                where = f"config file {arg}"
                _check_key(key, defaults, where)
                config[key] = _coerce(key, value, defaults[key], where)
                given.add(key)
    return config


def answer_help(script):
    """`SCRIPT --help` (or -h) printed from the script's source and exit 0: the scripts call this before
    importing torch, so that the question costs a fraction of a second, not torch's import. Otherwise a
    torch older than the code runs on is refused here, in one line, before anything is done."""
    if '-h' in sys.argv[1:] or '--help' in sys.argv[1:]:
        print(help_text(script, script_defaults(script)))
        sys.exit(0)
    from importlib.metadata import PackageNotFoundError, version
    try:
        too_old = torch_too_old(version('torch'))  # from its metadata: importing torch takes seconds
    except PackageNotFoundError:
        return  # the import says so
    if too_old:
        print(f"{os.path.basename(sys.argv[0])}: error: {too_old}", file=sys.stderr)
        sys.exit(2)


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few kilobytes: a larger one is not a config file
MIN_TORCH = (2, 6)  # requirements.txt's bound: the oldest release with everything used here


def torch_too_old(release):
    """Why torch `release` (a version string, e.g. '2.5.1a0+gitc8f2e2a' from a Gaudi container) cannot run
    this code, or None."""
    parts = release.split('.')
    try:
        major, minor = int(parts[0]), int(''.join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return None  # a version we cannot read: the import decides
    if (major, minor) >= MIN_TORCH:
        return None
    return (f"torch {release} is older than {'.'.join(map(str, MIN_TORCH))}, the oldest release this code runs on "
            f"(FSDP2's fully_shard, distributed checkpoints): install a newer torch (pip install -r requirements.txt "
            f"keeps one that is recent enough), or on Intel Gaudi use its software 1.21 or newer")


def optional_bool(key, value):
    """A setting whose default None means "keep what the checkpoint says" (noise_at_eval): None,
    True or False, also as typed on a command line in any case ('false'). Else ConfigError."""
    if isinstance(value, str) and value.lower() in ('true', 'false'):
        value = value.lower() == 'true'
    if value not in (None, True, False) or type(value) not in (bool, type(None)):
        raise ConfigError(f"{key}={value!r} must be True or False")
    return value


MODEL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'model.py')
VARIANT_SETTINGS = 'globals().update(variant_settings())'  # the statement by which a script takes them


def variant_fields(model_file=MODEL_FILE):
    """{field: (default, meaning)} of GPTConfig's fields that an attention variant reads (named by a config_fields
    in model.py), the meaning being the comment on the field's line: read from model.py's source, because the
    scripts answer --help and check keys before importing torch (which model.py imports)."""
    with open(model_file) as f:
        source = f.read()
    tree = ast.parse(source)
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', None) == 'config_fields':
            used.update(ast.literal_eval(node.value))
    config = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == 'GPTConfig')
    comments = _comments(source)
    return {node.target.id: (ast.literal_eval(node.value), comments.get(node.end_lineno, ''))
            for node in config.body if isinstance(node, ast.AnnAssign) and node.target.id in used}


def attention_names(model_file=MODEL_FILE):
    """The keys of model.py's ATTENTION_TYPES, read from its source (as variant_fields); [] where they cannot be read
    that way, leaving the check to GPTConfig."""
    with open(model_file) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', None) == 'ATTENTION_TYPES' and \
                isinstance(node.value, ast.Dict):
            return [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    return []


def variant_settings():
    """{field: GPTConfig's default} of every variant's own settings (variant_fields)."""
    return {key: default for key, (default, _) in variant_fields().items()}


def _takes_variant_settings(node):
    return isinstance(node, ast.Expr) and ast.unparse(node) == VARIANT_SETTINGS


def _comments(source):
    """{line number: the text of the comment on it}"""
    return {tok.start[0]: tok.string.lstrip('#').strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}


def script_defaults(script):
    """A script's settings without running it: its top-level assignments up to `config_keys = ...`,
    evaluated like a config file (they are literals), and the variant settings where it takes them."""
    with open(script) as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == 'config_keys':
                break
            defaults[node.targets[0].id] = eval(compile(ast.Expression(node.value), script, 'eval'), {})
        elif _takes_variant_settings(node):
            defaults.update(variant_settings())
    return defaults


def help_text(script, defaults):
    """The script's docstring, its usage and one line per key: --key=default  meaning. The meaning
    is the comment on the key's line in the script; a comment line of its own before a group of
    keys (e.g. `# adamw optimizer`) becomes a heading."""
    with open(script) as f:
        source = f.read()
    tree = ast.parse(source)
    comments = _comments(source)
    lines = source.splitlines()
    name = os.path.basename(script)
    out = [(ast.get_docstring(tree) or '').strip(), '',
           f"usage: python3 {name} [config_file.py ...] [--key=value ...]",
           "  Arguments apply left to right: a config file sets the keys it assigns, --key=value one key.",
           '', 'settings (default, meaning):']
    previous_end = 0
    for node in tree.body:
        if _takes_variant_settings(node):
            out += [f"    --{key}={defaults[key]!r}  {meaning}" for key, (_, meaning) in variant_fields().items()
                    if key in defaults]
            previous_end = node.end_lineno
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        if node.targets[0].id == 'config_keys':
            break  # the settings end there (script_defaults); what follows may assign a key again
        if node.targets[0].id not in defaults:
            continue
        key = node.targets[0].id
        for line_no in range(max(previous_end + 1, node.lineno - 3), node.lineno):  # a heading just above
            text = lines[line_no - 1].strip()
            if line_no in comments and text.startswith('#') and not set(text) <= set('#-= '):
                out.append(f"  {comments[line_no]}:")
        previous_end = node.end_lineno
        meaning = comments.get(node.end_lineno, '')
        out.append(f"    --{key}={defaults[key]!r}" + (f"  {meaning}" if meaning else ''))
    return '\n'.join(out)


def _read_config_file(path):
    """The names a config file assigns, from executing it in an empty namespace."""
    if os.path.exists(path) and not os.path.isfile(path):  # read before the check: a FIFO would hang
        what = 'a folder' if os.path.isdir(path) else 'not a regular file (a FIFO, socket or device)'
        raise ConfigError(f"config file {path} is {what}: give a config file such as config/train_shakespeare_char.py")
    if not os.path.isfile(path):
        folder = os.path.dirname(path) or '.'
        names = sorted(n for n in os.listdir(folder) if n.endswith('.py')) if os.path.isdir(folder) else []
        close = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.6)
        hint = (" (overrides need two dashes: --key=value)" if '=' in path
                else f" (did you mean {os.path.join(os.path.dirname(path), close[0])}?)" if close else "")
        raise ConfigError(f"config file {path} not found{hint}")
    source = _config_source(path)
    namespace = {}
    try:
        exec(compile(source, path, 'exec'), namespace)
    except Exception as e:  # a syntax error or an expression that fails: say which file and line
        line = getattr(e, 'lineno', None) or _traceback_line(e, path)
        raise ConfigError(f"config file {path}{f', line {line}' if line else ''}: "
                          f"{type(e).__name__}: {e}") from e
    values = {}
    for key, value in namespace.items():
        if key.startswith('_'):
            continue  # __builtins__, and private helpers a file may keep
        if isinstance(value, (types.ModuleType, types.FunctionType, type)):
            raise ConfigError(f"config file {path}: {key!r} is a {type(value).__name__}; config files "
                              f"hold plain assignments of values (no imports, functions or classes)")
        values[key] = value
    return values


def _config_source(path):
    """The text of the config file at path, read as the regular file it is when opened (a FIFO put there after
    the checks above is refused, not waited on), at most MAX_CONFIG_BYTES, UTF-8."""
    fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NONBLOCK', 0))
    with open(fd, 'rb') as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"config file {path} is not a regular file: give a config file such as "
                              f"config/train_shakespeare_char.py")
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB, which no config file is "
                          f"(they are a few lines of assignments): give a config file such as "
                          f"config/train_shakespeare_char.py")
    try:
        return data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}): give a config file such as "
                          f"config/train_shakespeare_char.py") from None


def _traceback_line(exc, path):
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _check_key(key, defaults, where):
    if key in defaults:
        return
    close = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "; run with a valid key (see the defaults at the top of the script)"
    raise ConfigError(f"{where}: unknown config key {key!r}{hint}")


def _parse_cli_value(text, default):
    """--key=value text -> a Python value: a literal when it parses as one, else the raw string."""
    if isinstance(default, bool) and text.lower() in ('true', 'false'):
        return text.lower() == 'true'
    if isinstance(default, list):  # --attn_types=base,diff or --seeds=[1, 2] or --seeds=1,2
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return [_parse_cli_value(item.strip(), '') for item in text.split(',') if item.strip()]
        return list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if type(default) is float:
            try:  # inf, -inf, nan: a float, as float('inf') in a config file, so the script's range check names it
                return float(text)
            except ValueError:
                pass
        return text  # e.g. --out_dir=out-run1, --init_from=gpt2
    if isinstance(default, str) and not isinstance(value, str):
        return text  # a string key keeps what was typed: --wandb_run_name=124 is the name '124'
    return value


def _coerce(key, value, default, where):
    """value, checked against the type of default (int is widened to float)."""
    if default is None:
        return value
    expected = type(default)
    if expected is list and type(value) is tuple:
        return list(value)
    if expected is float and type(value) is int:  # bool is an int subclass, but not a number here
        return float(value)
    if type(value) is expected:
        return value
    if default == 'auto' and type(value) is bool:
        return value  # an on / off / 'auto' setting (compile): the script checks its string values
    if expected is bool:
        wanted = "True or False"
    else:
        article = 'an' if expected.__name__[0] in 'aeiou' else 'a'
        wanted = f"{article} {expected.__name__} like the default {default!r}"
    raise ConfigError(f"{where}: {key} must be {wanted}, got {value!r} ({type(value).__name__})")
