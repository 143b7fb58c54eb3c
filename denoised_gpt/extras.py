"""What the light install leaves out. requirements.txt holds what training, sampling and data preparation need;
requirements-extras.txt adds evaluation (lm-eval, matplotlib), LoRA (peft) and the Hugging Face format
(transformers). A script that needs one of those says so, with the command, before any work."""
import importlib.util

INSTALL = "pip install -r requirements-extras.txt"


def require(module, what):
    """ValueError naming what needs `module` and the command that installs it, when it is not installed."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs {module}, which the light install (requirements.txt) leaves out: {INSTALL}")
